"""RMSNorm, SwiGLU and RoPE as Triton kernels (``trainer.features.fused_ops.patch``): one pass each instead of
several elementwise ops, on a CUDA GPU of sm80+ with Triton; transformers' own ops elsewhere."""

from __future__ import annotations

import torch

from trainer.features.fused_ops import patch as fused_ops
from trainer.plan.feature import Context, Target, Undo
from trainer.plan.hardware import Hardware
from trainer.plan.types import Decision, ModelFacts

NAME = "fused_ops"


def supported(hw: Hardware, facts: ModelFacts) -> str | None:
    if hw.device != "cuda":
        return "CPU: transformers' own RMSNorm, SwiGLU and RoPE ops"
    if not hw.triton:
        return "triton is not installed: transformers' own ops"
    if hw.capability is not None and hw.capability < (8, 0):
        major, minor = hw.capability
        return f"sm{major}{minor}: the Triton RMSNorm/SwiGLU/RoPE kernels need sm80 or newer"
    return None


def _decide(hw: Hardware, facts: ModelFacts) -> Decision:
    missing = supported(hw, facts)
    if missing is not None:
        return Decision(NAME, "auto", False, None, missing)
    return Decision(
        NAME, "auto", True, "triton",
        "Triton RMSNorm, SwiGLU and RoPE kernels: one pass each instead of several elementwise ops",
    )


class FusedOps:
    """The ``fused_ops`` kernel choice: Triton RMSNorm / SwiGLU / RoPE, or transformers' ops."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return supported(ctx.hw, ctx.facts)

    def decide(self, ctx: Context) -> Decision:
        return _decide(ctx.hw, ctx.facts)

    def apply(self, model: torch.nn.Module, decision: Decision, target: Target) -> Undo:
        """Patch the recognised RMSNorm / MLP modules (and RoPE) of ``model`` when enabled.

        Backend ``triton`` runs the kernels; ``torch`` patches the same modules with the kernels'
        torch forms (the CPU reference the equivalence tests use; RoPE stays transformers').
        """
        if not decision.enabled:
            return Undo()
        result = fused_ops.install(model, triton=decision.backend == "triton")
        return Undo(f"fused elementwise: {result.describe()}", result.uninstall)


FEATURE = FusedOps()
