"""The standard benchmark workload: sample lengths, packed steps, synthetic batches, model shapes.

Every speed claim in docs/benchmarks.md uses this one workload (issue 3): lognormal sample
lengths (median 250, sigma 1, seed 0, clipped to [16, 4096]) packed into steps of exactly
16,384 real tokens; synthetic token ids; random-weight models built from transformers config
classes (nothing is downloaded), LoRA r=16 alpha=16 on q,k,v,o,gate,up,down, gradient
checkpointing, bf16, AdamW on the LoRA weights. MoE shapes (GPT-OSS-20B) put LoRA on the
attention projections and, through peft ``target_parameters``, on the 3-D expert weights
(``trainer.features.moe.routing.expert_lora_targets``: they are not ``nn.Linear``). Model FLOPs (MFU) are
``trainer.training.flops.FlopCounter.for_model`` of the built model, the trainer's own count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

TOKENS_PER_STEP = 16_384
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lognormal_lengths(count: int, *, seed: int = 0, median: float = 250.0, sigma: float = 1.0,
                      low: int = 16, high: int = 4096) -> list[int]:
    """``count`` sample lengths, lognormal around ``median``, clipped to [low, high]."""
    rng = random.Random(seed)
    return [min(max(int(rng.lognormvariate(math.log(median), sigma)), low), high) for _ in range(count)]


def packed_steps(num_steps: int, *, tokens_per_step: int = TOKENS_PER_STEP, seed: int = 0) -> list[list[int]]:
    """Sample lengths per step, each step exactly ``tokens_per_step`` real tokens.

    Samples are drawn in order; a sample that does not fit the step's remainder is cut to fill
    it exactly, and the next step starts with a fresh draw (so no step has padding).
    """
    stream = iter(lognormal_lengths(num_steps * tokens_per_step // 16 + 1, seed=seed))
    steps = []
    for _ in range(num_steps):
        lengths, room = [], tokens_per_step
        while room:
            n = min(next(stream), room)
            lengths.append(n)
            room -= n
        steps.append(lengths)
    return steps


@dataclass(frozen=True)
class PackedBatch:
    """One packed step on the device, with host-side metadata (no sync needed to read it)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 per sample
    labels: torch.Tensor  # [1, T], -100 on each sample's first token (HF shifts them inside its loss)
    targets: torch.Tensor  # [1, T], already shifted: next token of the same sample, -100 on its last
    cu_seqlens: torch.Tensor  # int32 [N + 1]
    lengths: tuple[int, ...]
    max_seqlen: int
    num_label_tokens: int  # targets the shifted loss counts: sum(L - 1)


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor  # [N, Lmax]
    attention_mask: torch.Tensor  # [N, Lmax]
    labels: torch.Tensor  # [N, Lmax], -100 on padding
    real_tokens: int


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device without a host sync: pinned memory, non-blocking copy (as the trainer does)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def packed_batch(lengths: list[int], vocab_size: int, device: torch.device, seed: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(0, vocab_size, (1, T), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels = ids.clone()
    labels[0, starts] = -100
    targets = torch.full_like(ids, -100)
    targets[0, :-1] = ids[0, 1:]
    targets[0, starts + torch.tensor(lengths) - 1] = -100
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return PackedBatch(
        input_ids=_to(ids, device), position_ids=_to(positions, device), labels=_to(labels, device),
        targets=_to(targets, device), cu_seqlens=_to(cu, device), lengths=tuple(lengths), max_seqlen=max(lengths),
        num_label_tokens=sum(n - 1 for n in lengths),
    )


def padded_batch(lengths: list[int], vocab_size: int, device: torch.device, seed: int) -> PaddedBatch:
    """The same samples, one per row, right-padded to the longest (what stock HF does without packing)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, vocab_size, (n,), generator=gen)
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return PaddedBatch(_to(ids, device), _to(mask, device), _to(labels, device), sum(lengths))


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str  # "llama" | "qwen3" | "gpt_oss"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    """Routed experts per MoE layer (0: a dense MLP)."""
    experts_per_token: int = 0
    sliding_window: int | None = None
    """Window of the sliding-attention layers (GPT-OSS: every other layer, the config's default)."""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """LoRA ``target_modules``; a MoE shape adds the expert weights as ``target_parameters``."""
        return LORA_TARGETS[:4] if self.is_moe else LORA_TARGETS

    def config(self, attn_implementation: str = "sdpa"):
        from transformers import LlamaConfig, Qwen3Config

        common = {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                  "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                  "intermediate_size": self.intermediate, "vocab_size": self.vocab,
                  "max_position_embeddings": 32768, "tie_word_embeddings": False}
        if self.family == "gpt_oss":
            from transformers import GptOssConfig

            # The config class's own max positions (yarn RoPE) and alternating sliding/full layers.
            del common["max_position_embeddings"]
            config = GptOssConfig(**common, num_local_experts=self.experts,
                                  num_experts_per_tok=self.experts_per_token, sliding_window=self.sliding_window)
            # GPT-OSS has no SDPA path in transformers (its attention sinks): eager is its plain default.
            if attn_implementation == "sdpa":
                attn_implementation = "eager"
        else:
            cls = Qwen3Config if self.family == "qwen3" else LlamaConfig
            config = cls(**common)
        config._attn_implementation = attn_implementation
        return config

    def param_count(self) -> int:
        """Parameters of the base model (embeddings, head, projections, MLP or experts; norms and biases
        ignored): what the weights cost in GPU memory, for the plan's offload estimate."""
        attn_proj = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        if self.is_moe:
            mlp = self.experts * mlp + self.hidden * self.experts
        return self.layers * (attn_proj + mlp) + 2 * self.hidden * self.vocab


QWEN3_0_6B = ModelShape("Qwen3-0.6B", "qwen3", 1024, 28, 16, 8, 128, 3072, 151_936)
LLAMA_3_1_8B = ModelShape("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14_336, 128_256)
GPT_OSS_20B = ModelShape("GPT-OSS-20B", "gpt_oss", 2880, 24, 64, 8, 64, 2880, 201_088, experts=32,
                         experts_per_token=4, sliding_window=128)
"""transformers ``GptOssConfig`` at the 20B checkpoint's sizes: 32 experts, top-4, window 128 on alternating layers."""
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "llama-8b": LLAMA_3_1_8B}
"""The dense shapes of bench.train_step (GPT-OSS-20B is bench.ablation's: stock has no SDPA path for it)."""


def build_lora_model(shape: ModelShape, device: torch.device, attn_implementation: str = "sdpa"):
    """Random-weight bf16 model with LoRA adapters, gradient checkpointing on; returns (model, optimizer).

    Built and initialised directly on ``device``: no CPU copy of the weights, no CPU init.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = shape.config(attn_implementation)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    # transformers 5.23 renamed the switch (the GPU image's 5.17 may only have the old name).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    extra = {}
    if shape.is_moe:
        from trainer.features.moe import routing as moe_routing

        extra["target_parameters"] = moe_routing.expert_lora_targets(model)  # peft >= 0.17
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=list(shape.lora_targets),
                      task_type="CAUSAL_LM", **extra)
    model = get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    return model, optimizer
