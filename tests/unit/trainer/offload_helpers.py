"""Shared pieces of the offload tests: tiny LoRA models in each checkpointing mode, a two-micro-batch
step, and the bitwise comparison (tests/unit/trainer/test_offload*.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.model.load import enable_gradient_checkpointing
from trainer.features.offload import ActivationOffloader

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 96,
}
LENGTHS_1 = (5, 9, 4)
LENGTHS_2 = (7, 3, 12, 6)
"""The second micro-batch is longer: the reload buffers must grow."""
MODES = ("none", "checkpoint", "offload-single", "offload-double")


def make_model(
    family: str,
    mode: str,
    *,
    dropout: float = 0.0,
    layers: int = 4,
    rng: bool = True,
    streams: Any = None,
) -> Any:
    """A tiny random-weight model with LoRA (random B, so A gets gradients too) in ``mode``."""
    import peft
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    common = {**COMMON, "num_hidden_layers": layers, "attention_dropout": dropout}
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.config.use_cache = False
    if mode == "checkpoint":
        enable_gradient_checkpointing(model)  # the trainer's, for each transformers release
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.train()
    if mode.startswith("offload"):
        offloader = ActivationOffloader(
            "cpu",
            double_buffer=mode == "offload-double",
            preserve_rng_state=rng,
            streams=streams,
        )
        offloader.apply(model)
        model.offloader = offloader
    return model


def make_batch(lengths: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "position_ids": positions}


def loss_of(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**batch, use_cache=False).logits
    return F.cross_entropy(
        logits[0, :-1].float(), batch["input_ids"][0, 1:], reduction="sum"
    )


def train_step(
    model: Any, seed: int = 1
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two micro-batches (gradient accumulation), seeded per forward; returns losses and LoRA grads."""
    losses = []
    for i, lengths in enumerate((LENGTHS_1, LENGTHS_2)):
        torch.manual_seed(seed + i)
        loss = loss_of(model, make_batch(lengths, seed=10 + i))
        loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, grads


def assert_bitwise(a: tuple, b: tuple) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(loss_a, loss_b, strict=True)), (
        loss_a,
        loss_b,
    )
    assert grads_a.keys() == grads_b.keys()
    assert len(grads_a) > 0
    for name in grads_a:
        assert torch.count_nonzero(grads_a[name]) > 0, f"{name} got no gradient"
        assert torch.equal(grads_a[name], grads_b[name]), (
            name,
            (grads_a[name] - grads_b[name]).abs().max().item(),
        )
