"""GPU memory of one training step under each activation policy: what the plan chooses it from.

``estimate(shape, workload, policy)`` adds up, in bytes, what is live at the step's peak
(``torch.cuda.max_memory_allocated``), from the model's config alone (no weights loaded):

- **weights**: base parameters in the compute dtype; QLoRA's decoder linears in NF4 at
  ``NF4_BYTES`` per weight (4 bits + an 8-bit absmax per block of 64 + an fp32 scale per 256
  blocks: 0.516 bytes), the rest (embeddings, head, norms, 3-D MoE experts) in the dtype. Full
  fine-tuning under FSDP2: fp32 master shards (``4 P / W``) plus two gathered layers.
- **trainable state**: LoRA weights are fp32 (peft upcasts adapters), so weight, gradient and
  AdamW's two moments are 16 bytes per LoRA parameter; full fine-tuning trains the weights in
  their dtype: gradient + two moments, 3 x dtype bytes per parameter (fp32 masters under FSDP2:
  12 bytes, sharded over the ranks).
- **saved activations**, per token per decoder layer when the layer keeps everything::

      dense   b x (4H + 2 Hq D + 2 Hkv D + 3I)        (+ Hq D + Hkv D with q/k norms, Qwen3)
      MoE     b x (4H + 2 Hq D + 2 Hkv D + k (H + 3 Ie)) + 4 E   (k of E experts, router fp32)

  plus, with LoRA on the experts, the layer's merged expert weight ``W + B A`` (peft builds it
  in every forward and the expert matmuls save it): ``b x 3 E H Ie`` per layer, not per token.

  ``b`` is the dtype's bytes. Validated on Llama-3.1-8B LoRA (H 4096, Hq 32, Hkv 8, D 128,
  I 14,336): 139.3 KB estimated vs 138.4 KB measured per token per layer (90.1 GB peak
  without checkpointing vs 24.1 GB with full checkpointing at 16,384 tokens, H200).
  A checkpointed layer keeps only its input, ``b x H`` per token; in backward one layer at a
  time is recomputed with everything (``+ 1 layer``). Per policy, on the GPU::

      none            L layers x all
      selective (n)   (L - n) x all + n x input                the first n of L layers checkpointed
      full            L x input + 1 x all
      full + offload  1 x input (the last layer's) + 2 reload buffers + 1 x all

  Selective checkpoints the first n layers: backward recomputes them last, when the others'
  activations are freed (``n x input + 1 x all`` then, below the peak at backward's start).

- **workspace**: the larger of the fused loss's chunk (``12 x chunk x V`` bytes: fp32 logits,
  their gradient and a low-precision copy; ``12 x T x V`` with the plain loss) and backward's
  transient MLP gradients (``2 b x I`` per token; with expert LoRA also the merged expert
  weight's gradient), plus the hidden-state gradient the fused
  loss keeps from forward to backward (``b x H`` per token), the largest dequantized NF4
  weight (QLoRA). Eager attention (no packed kernel) also keeps each layer's scores and
  probabilities, ``2 b x Hq x T x min(T, max_seq_len)`` (an upper bound: samples are shorter).

The estimate is of allocated bytes; the caching allocator and the CUDA context take more, so
the plan compares it with the free memory minus ``margin`` (``2 GiB + 3%``). A wrong estimate
does not crash a job: an out-of-memory error in the first steps steps down the ladder
(``trainer.parallel.oom_ladder``). ``bench/memory_estimate.py`` prints estimated vs measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8
"""Bytes per NF4 weight with double-quantized absmax (``trainer.model.load.nf4_config``): 0.5159."""
LORA_STATE_BYTES = 16
"""fp32 LoRA weight + gradient + AdamW's two fp32 moments."""
MARGIN_FIXED = 2 * GIB
MARGIN_SHARE = 0.03
"""``margin`` = 2 GiB + 3% of the budget: the CUDA context and library workspaces (cuBLAS,
NCCL) that ``max_memory_allocated`` does not count, and the caching allocator's fragmentation."""
LOSS_CHUNK_BYTES_PER_LOGIT = 12
"""fp32 logits + their fp32 gradient + the low-precision copy (``trainer.features.loss.fused``)."""
QK_NORM_MODELS = frozenset({"qwen3", "qwen3_moe", "olmo2", "gemma3_text"})
"""Model types whose attention normalises q and k per head (two more saved tensors)."""
POLICIES = ("none", "selective", "full", "full+offload")
"""The activation policies, from the fastest (most memory) down the OOM ladder."""
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

CHUNK_BYTES = 256 * 2**20
"""Target size of one chunk's fp32 logits in the fused loss (``trainer.features.loss.fused``);
``default_chunk_size`` turns it into tokens. Here, not there, so this module stays standard-library
only: the API estimates whether a model fits (``api.models.fit``) without importing torch."""


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk: a power of two keeping one chunk's fp32 logits near ``CHUNK_BYTES``.

    512 tokens for Llama 3's 128k vocabulary, 256 for Qwen 3's 152k (~250 MiB of fp32 logits
    per chunk, ~0.75 GiB with the gradient and the low-precision copies); clamped to [128, 8192]
    so small vocabularies do not launch thousands of tiny matmuls. At 16k tokens that is 32 or
    64 chunks, each a large enough matmul to keep an H100/H200 busy.
    """
    tokens = CHUNK_BYTES // (4 * vocab_size)
    return int(min(8192, max(128, 2 ** math.floor(math.log2(max(tokens, 1))))))


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder-only model that its memory depends on (from its config)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    tied_embeddings: bool = False
    qk_norm: bool = False
    param_count: int | None = None
    """Base parameters as counted on the built model; None: the arithmetic of ``base_params``."""

    @classmethod
    def from_config(cls, hf_config: Any, param_count: int | None = None) -> Shape | None:
        """Read a transformers config; None when it lacks a size the estimate needs."""
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        get = lambda *names: next((v for n in names if (v := getattr(text, n, None))), None)  # noqa: E731
        layers, hidden, heads = get("num_hidden_layers"), get("hidden_size"), get("num_attention_heads")
        intermediate, vocab = get("intermediate_size"), get("vocab_size")
        if not (layers and hidden and heads and intermediate and vocab):
            return None
        experts = get("num_local_experts", "num_experts") or 0
        return cls(
            layers=layers, hidden=hidden, heads=heads, kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads, intermediate=intermediate, vocab=vocab,
            experts=experts, experts_per_token=get("num_experts_per_tok", "moe_topk") or (1 if experts else 0),
            expert_intermediate=get("moe_intermediate_size") or intermediate if experts else 0,
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qk_norm=getattr(text, "model_type", None) in QK_NORM_MODELS,
            param_count=param_count,
        )

    @property
    def attention_params(self) -> int:
        """q, k, v, o of one layer."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def linear_params(self) -> int:
        """Weights of one layer's ``nn.Linear`` projections (what QLoRA stores in NF4)."""
        mlp = self.experts * self.hidden if self.experts else 3 * self.hidden * self.intermediate
        return self.attention_params + mlp

    @property
    def expert_params(self) -> int:
        """One layer's 3-D expert weights (gate, up, down per expert); 0 for a dense model."""
        return 3 * self.experts * self.hidden * self.expert_intermediate

    def base_params(self) -> int:
        """Every base parameter (norms and biases ignored when not counted on the model)."""
        if self.param_count:
            return self.param_count
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (self.linear_params + self.expert_params) + embeddings

    def lora_params(self, rank: int) -> int:
        """LoRA on every linear projection (``all-linear``), and on a MoE model's expert weights
        (peft ``target_parameters``: rank ``r`` per expert on each 3-D weight)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = (h + q) + 2 * (h + kv) + (q + h)
        if self.experts:
            e, i = self.experts, self.expert_intermediate
            mlp = (h + e) + e * ((h + 2 * i) + (i + h))  # router, gate_up, down
        else:
            mlp = 3 * (h + self.intermediate)
        return self.layers * rank * (attention + mlp)

    def activation_elements_per_token(self) -> int:
        """Elements one layer saves per token when it keeps everything (module docstring)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 4 * self.hidden + 2 * q + 2 * kv + (q + kv if self.qk_norm else 0)
        if self.experts:
            return attention + self.experts_per_token * (self.hidden + 3 * self.expert_intermediate)
        return attention + 3 * self.intermediate


@dataclass(frozen=True)
class Workload:
    """What the job asks of one rank: its micro-batch, method and how the model is spread."""

    tokens: int
    """Real tokens per packed micro-batch (``data.batch_tokens``)."""
    max_seq_len: int
    method: str = "lora"
    dtype: str = "bfloat16"
    lora_rank: int = 16
    world_size: int = 1
    sharded: bool = False
    """FSDP2: parameters (and, for full fine-tuning, their optimizer state) sharded over the ranks."""
    fused_loss: bool = True
    packed_attention: bool = True
    """A varlen/flex kernel runs attention (no ``T x T`` probabilities are kept)."""

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.dtype, 2)


@dataclass(frozen=True)
class Estimate:
    """Bytes at the step's peak under one policy."""

    policy: str
    checkpointed_layers: int
    weights: int
    trainable: int
    """Gradients + optimizer state (+ fp32 LoRA weights)."""
    activations: int
    workspace: int

    @property
    def peak(self) -> int:
        return self.weights + self.trainable + self.activations + self.workspace

    def describe(self) -> str:
        """``est. 83.9 GiB (weights 15.0, grads+optimizer 0.6, activations 68.0, workspace 0.4)``."""
        parts = (self.weights, self.trainable, self.activations, self.workspace)
        w, t, a, s = (f"{x / GIB:.1f}" for x in parts)
        return f"est. {self.peak / GIB:.1f} GiB (weights {w}, grads+optimizer {t}, activations {a}, workspace {s})"


def estimate(shape: Shape, work: Workload, policy: str, checkpointed: int | None = None) -> Estimate:
    """Peak bytes of one step under ``policy`` (``POLICIES``); ``checkpointed`` layers for
    ``selective`` (default: half of them)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    n = {"none": 0, "selective": shape.layers // 2 if checkpointed is None else checkpointed}.get(policy, shape.layers)
    b, t = work.dtype_bytes, work.tokens
    whole = t * b * shape.activation_elements_per_token() + _router_bytes(shape, t) + _merged_experts(shape, work)
    if not work.packed_attention:  # eager attention keeps scores and probabilities per layer
        whole += 2 * b * shape.heads * t * min(t, work.max_seq_len)
    layer_input = t * b * shape.hidden
    if policy == "full+offload":
        activations = 3 * layer_input + whole
    else:
        activations = (shape.layers - n) * whole + n * layer_input + (whole if n == shape.layers else 0)
    return Estimate(policy, n, _weights(shape, work), _trainable(shape, work), activations, _workspace(shape, work))


def _merged_experts(shape: Shape, work: Workload) -> int:
    """LoRA on 3-D expert weights (peft ``target_parameters``) materialises ``W + B A`` for the
    layer in every forward, and the expert matmuls save it for backward: weight-sized, per layer."""
    return work.dtype_bytes * shape.expert_params if shape.experts and work.method != "full" else 0


def _router_bytes(shape: Shape, tokens: int) -> int:
    return 4 * shape.experts * tokens if shape.experts else 0


def _weights(shape: Shape, work: Workload) -> int:
    b, params = work.dtype_bytes, shape.base_params()
    if work.method == "qlora":
        linear = shape.layers * shape.linear_params
        return round(linear * NF4_BYTES + (params - linear) * b)
    if work.method == "full" and work.sharded:
        return math.ceil(4 * params / work.world_size) + 2 * b * (shape.linear_params + shape.expert_params)
    if work.sharded:  # LoRA base sharded under FSDP2: bf16 shards plus two gathered layers
        return math.ceil(b * params / work.world_size) + 2 * b * (shape.linear_params + shape.expert_params)
    return b * params


def _trainable(shape: Shape, work: Workload) -> int:
    if work.method == "full":
        per_param = 12 if work.sharded else 3 * work.dtype_bytes
        return math.ceil(per_param * shape.base_params() / (work.world_size if work.sharded else 1))
    return LORA_STATE_BYTES * shape.lora_params(work.lora_rank)


def _workspace(shape: Shape, work: Workload) -> int:
    b, t = work.dtype_bytes, work.tokens
    chunk = min(t, default_chunk_size(shape.vocab)) if work.fused_loss else t
    loss = LOSS_CHUNK_BYTES_PER_LOGIT * chunk * shape.vocab
    backward = 2 * b * t * (shape.expert_intermediate * shape.experts_per_token if shape.experts else shape.intermediate)
    backward += _merged_experts(shape, work)  # the merged expert weight's gradient, for B and A
    dequantized = 2 * b * shape.hidden * max(shape.intermediate, shape.heads * shape.head_dim) if work.method == "qlora" else 0
    return max(loss, backward) + b * t * shape.hidden + dequantized


def margin(budget: int) -> int:
    """GPU memory kept free beyond the estimate (``MARGIN_FIXED`` + ``MARGIN_SHARE``)."""
    return MARGIN_FIXED + int(MARGIN_SHARE * budget)


@dataclass(frozen=True)
class Budget:
    """The GPU memory a run may plan for: the free memory at start, or the job's cap if lower."""

    free: int
    cap: int | None = None

    @property
    def usable(self) -> int:
        limit = self.free if self.cap is None else min(self.free, self.cap)
        return max(0, limit - margin(limit))

    def describe(self) -> str:
        """``139.7 GiB free - 6.2 GiB margin`` (with the cap named when it binds)."""
        limit = self.free if self.cap is None else min(self.free, self.cap)
        where = f"{self.free / GIB:.1f} GiB free"
        if self.cap is not None and self.cap < self.free:
            where = f"{self.cap / GIB:.1f} GiB (max_gpu_memory_gb; {self.free / GIB:.1f} GiB free)"
        return f"{where} - {margin(limit) / GIB:.1f} GiB margin"


def fewest_checkpointed(shape: Shape, work: Workload, usable: int) -> Estimate | None:
    """The ``selective`` estimate with the fewest checkpointed layers (1 .. L-1) that fits in
    ``usable`` bytes, or None when even L-1 checkpointed layers do not fit."""
    for n in range(1, shape.layers):
        est = estimate(shape, work, "selective", n)
        if est.peak <= usable:
            return est
    return None


def free_gpu_bytes(device: Any) -> int | None:
    """Free memory of ``device`` now (``torch.cuda.mem_get_info``: what other processes left), or
    None off CUDA. Read once at start, before the model loads."""
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()  # blocks this process cached before (hardware's peak measurement) are free
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
