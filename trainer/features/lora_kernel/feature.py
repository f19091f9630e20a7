"""How peft's LoRA linear layers run: ``trainer.features.lora_kernel.fused`` (compute dtype, the low-rank update
fused into the base matmul, no fp32 copies of activations) or peft's own forward."""

from __future__ import annotations

import torch

from dataclasses import dataclass

from trainer.features.lora_kernel import fused as lora_fused
from trainer.plan.feature import Context, Target, Undo
from trainer.plan.types import Decision

NAME = "lora_kernel"
FUSED, PEFT = lora_fused.KERNEL_NAME, "peft"


def _decide(method: str, dropout: float) -> Decision:
    if method == "full":
        return Decision(NAME, "auto", False, None, "method full: no adapters")
    if dropout:
        return Decision(
            NAME, "auto", False, PEFT,
            f"peft's LoRA forward: lora.dropout={dropout} (the fused path has no dropout)",
        )
    return Decision(
        NAME, "auto", True, FUSED,
        "LoRA in the compute dtype with the update fused into the base matmul: no fp32 copies of activations",
    )


@dataclass
class LoraHandle(Undo):
    """The install's ``Undo`` plus its adapter cache (``lora_fused.AdapterCache``)."""

    cache: lora_fused.AdapterCache | None = None

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Cast the adapters once per ``optimizer`` step instead of in every use (no-op when off)."""
        if self.cache is not None:
            self.cache.watch(optimizer)


class LoraKernel:
    """The ``lora_kernel`` choice: fused LoRA linears in the compute dtype, or peft's forward."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        """The fused path runs on every machine and model peft adapts (it falls back per layer)."""
        return None

    def decide(self, ctx: Context) -> Decision:
        return _decide(ctx.job.method, ctx.job.lora_dropout)

    def apply(self, model: torch.nn.Module, decision: Decision, target: Target) -> LoraHandle:
        """Patch every plain peft LoRA linear of ``model`` to the fused path when enabled."""
        if not decision.enabled:
            return LoraHandle()
        result = lora_fused.install(model)
        return LoraHandle(f"LoRA kernel: {result.describe()}", result.uninstall, result.cache)


FEATURE = LoraKernel()
