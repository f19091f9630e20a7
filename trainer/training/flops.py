"""Model FLOPs of a training step: the one count behind every MFU ftq reports.

The trainer's ``step`` events (``trainer.training.metrics.mfu``) and the bench scripts (``bench.train_step``,
``bench.ablation``, ``bench.qlora``) count with this module, from the model they train:
``FlopCounter.for_model(model)`` walks the modules once, ``step_flops(lengths)`` counts a step.
Standard library only at import (torch is imported inside ``for_model``), so the count can be
read and tested without a model.

Model FLOPs, not hardware FLOPs: what the training math needs, whatever the kernels do.
Per token, for each matmul weight the token multiplies (``P`` its parameters)::

    frozen weight      4 P   forward 2P + input gradient 2P
    trainable weight   6 P   + weight gradient 2P

What the walk counts:

- ``nn.Linear`` by its logical shape ``in x out`` (a bitsandbytes 4-bit linear stores two weights
  per byte; its ``in_features``/``out_features`` are the logical ones), frozen or trainable as its
  weight's ``requires_grad`` says. The LM head is one (frozen unless trained or adapted).
- peft LoRA on a linear of rank ``r`` on ``(in, out)``: the base layer, plus A (``in x r``) and
  B (``r x out``), both trainable: ``2 r (in + out)`` forward per token, times 3.
- MoE experts (a module's 3-D weights ``[E, ., .]``): a token visits ``k`` of the ``E`` experts
  (the config's ``num_experts_per_tok``), so ``k / E`` of each weight counts. peft's LoRA on them
  (``target_parameters``) adds ``B A`` to the weight in every forward and backpropagates through
  the sum, so the summed weight gets a weight gradient: 6 per active parameter. That per-forward
  sum itself is weight-sized, not token-sized (under 1% of a GPT-OSS-20B step) and not counted.
- A router applied with ``F.linear`` on its own 2-D ``weight`` (GPT-OSS, Qwen3-MoE): all ``E`` outputs.
- Not counted: embeddings (a lookup), norms, biases, activations, the loss (element-wise work);
  the gradient-checkpointing recompute (model FLOPs count each forward once); the first layer's
  q, k, v input gradient, which autograd skips when the embeddings are frozen (0.17% of the 8B LoRA step).

Attention, in-sample and causal (packed samples never see each other), per layer and step::

    forward   4 * Hq * D * sum over samples of pairs(L)     QK^T and PV, 2 FLOPs per multiply-add
    pairs(L)  L (L + 1) / 2                                 a full causal layer
              w (w + 1) / 2 + (L - w) w   if L > w          a sliding-window layer (w keys, itself included)
    backward  2.5 x forward                                 dQ, dK, dV, dP and the score recompute
                                                            every flash-style kernel does (FlashAttention's
                                                            convention; bench.attention uses the same)

Worked example, Llama-3.1-8B with LoRA r=16 on q, k, v, o, gate, up, down (``bench.workload``):
frozen 32 x 218,103,808 + head 525,336,576 = 7,504,658,432 parameters, trainable (LoRA)
32 x 1,310,720 = 41,943,040, so 4 x 7,504,658,432 + 6 x 41,943,040 = 30.27 GFLOP per token for the
matmuls; a 16,384-token step with sum pairs(L) = 6,099,045 adds 3.5 x 4 x 4096 x 32 x 6,099,045
= 11.19 TFLOP of attention to 496.0 TFLOP of matmuls (tests/unit/trainer/training/test_flops.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ATTENTION_BACKWARD = 2.5
"""Attention backward FLOPs over its forward FLOPs (see the module docstring)."""
TOP_K_NAMES = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_topk")
"""Config attributes naming how many experts a token visits."""


@dataclass(frozen=True)
class AttentionLayers:
    """``count`` attention layers of one kind."""

    count: int
    width: int
    """Query heads x head dim."""
    window: int | None = None
    """Keys a query sees in a sliding-window layer (itself included); None for full causal layers."""

    def pairs(self, lengths: Iterable[int]) -> int:
        """(query, key) pairs one such layer computes over samples of these lengths."""
        w = self.window
        return sum(
            n * (n + 1) // 2 if w is None or n <= w else w * (w + 1) // 2 + (n - w) * w
            for n in lengths
        )

    def forward_flops(self, lengths: Iterable[int]) -> int:
        return 4 * self.width * self.count * self.pairs(lengths)


@dataclass(frozen=True)
class FlopCounter:
    """Model FLOPs of a packed training step (see the module docstring for what counts)."""

    frozen_params: int
    """Matmul weights a token multiplies that get no weight gradient (MoE: the active experts' share)."""
    trainable_params: int
    """Matmul weights a token multiplies that get a weight gradient (LoRA's A and B, a full fine-tune's)."""
    attention: tuple[AttentionLayers, ...] = field(default=())

    @classmethod
    def for_model(cls, model: Any) -> FlopCounter:
        """Walk ``model`` (transformers, optionally peft-wrapped, FSDP2-sharded or 4-bit) once."""
        config = _text_config(model.config)
        walk = _Walk(_experts_per_token(config))
        walk.visit(model, frozenset())
        return cls(walk.frozen, walk.trainable, attention_layers(config))

    def matmul_flops_per_token(self) -> int:
        return 4 * self.frozen_params + 6 * self.trainable_params

    def attention_flops(self, lengths: Sequence[int]) -> float:
        """Forward + backward attention FLOPs over samples of these lengths."""
        forward = sum(layers.forward_flops(lengths) for layers in self.attention)
        return (1.0 + ATTENTION_BACKWARD) * forward

    def step_flops(self, lengths: Sequence[int]) -> float:
        """Model FLOPs of a step that trains on samples of these lengths (all micro-batches)."""
        return float(self.matmul_flops_per_token() * sum(lengths)) + self.attention_flops(lengths)


def attention_layers(config: Any) -> tuple[AttentionLayers, ...]:
    """The attention layers of a transformers text config, grouped by window.

    A layer is windowed when ``layer_types`` says ``sliding_attention`` (GPT-OSS, Gemma), or on
    every layer of a Mistral config (its window has no layer types): the rule of
    ``trainer.features.attention.packed.uses_window``, which is what the packed attention applies.
    """
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or ())
    if window is None:
        windows = [None] * layers
    elif types:
        windows = [window if t == "sliding_attention" else None for t in types[:layers]]
    else:
        windows = [window if getattr(config, "model_type", None) == "mistral" else None] * layers
    kinds = dict.fromkeys(windows)  # first-seen order
    return tuple(AttentionLayers(windows.count(w), heads * head_dim, w) for w in kinds)


class _Walk:
    """Sums the matmul weights of a module tree into frozen and trainable parameters."""

    def __init__(self, top_k: int | None) -> None:
        self.top_k = top_k
        self.frozen = 0
        self.trainable = 0

    def add(self, params: int, trainable: bool) -> None:
        if trainable:
            self.trainable += params
        else:
            self.frozen += params

    def visit(self, module: Any, adapted: frozenset[str]) -> None:
        """Count ``module``; ``adapted``: its parameters a peft ``ParamWrapper`` puts LoRA on."""
        from torch import nn

        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            self._visit_lora(module, adapted)
        elif isinstance(module, nn.Linear):
            self.add(module.in_features * module.out_features, module.weight.requires_grad)
        elif not isinstance(module, (nn.Embedding, nn.modules.conv._ConvNd)):
            self._own_weights(module, adapted)
            for child in module.children():
                self.visit(child, frozenset())

    def _visit_lora(self, layer: Any, adapted: frozenset[str]) -> None:
        """A peft LoRA layer: its base, and the active adapters' A and B."""
        off = getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False)
        active = [] if off else [a for a in layer.active_adapters if a in layer.lora_A]
        name = getattr(layer, "parameter_name", None)
        if name is not None:  # ParamWrapper: B A is added to the base's weight ``name``
            self.visit(layer.base_layer, adapted | {name} if active else adapted)
            return
        self.visit(layer.base_layer, adapted)
        for adapter in active:
            self.visit(layer.lora_A[adapter], frozenset())
            self.visit(layer.lora_B[adapter], frozenset())

    def _own_weights(self, module: Any, adapted: frozenset[str]) -> None:
        """A module's own weights: 3-D expert weights (top-k of E), else a router's 2-D ``weight``."""
        own = dict(module.named_parameters(recurse=False))
        experts = {name: p for name, p in own.items() if p.dim() == 3}
        for name, p in experts.items():
            num_experts = p.shape[0]
            active = min(self.top_k or num_experts, num_experts)
            self.add(math.prod(p.shape[1:]) * active, p.requires_grad or name in adapted)
        weight = own.get("weight")
        if not experts and weight is not None and weight.dim() == 2:
            self.add(math.prod(weight.shape), weight.requires_grad or "weight" in adapted)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _experts_per_token(config: Any) -> int | None:
    for name in TOP_K_NAMES:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None
