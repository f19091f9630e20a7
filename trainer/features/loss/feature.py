"""The loss kernel: ``trainer.features.loss.fused`` (chunked LM head + cross-entropy, the full logits are
never materialised) where it can stand in for the model's head, else full logits in float32."""

from __future__ import annotations

import torch

from trainer.plan.feature import Context, Target
from trainer.plan.hardware import Hardware
from trainer.features.loss.packed_forward import LOSS_FUNCTIONS, LOSS_FUSED, LOSS_PLAIN
from trainer.data.packed_metadata import AnyPackedMetadata
from trainer.data.packing import PackedBatch
from trainer.plan.types import Decision, ModelFacts

NAME = "loss"


def supported(hw: Hardware, facts: ModelFacts) -> str | None:
    """Why the fused loss cannot stand in for this model's head (it runs on any machine), or None."""
    return facts.fused_loss


def _decide(hw: Hardware, facts: ModelFacts) -> Decision:
    missing = supported(hw, facts)
    if missing is None:
        kernel = hw.device == "cuda" and hw.triton  # trainer.kernels.cross_entropy.available
        rows = "; each chunk's softmax, loss and gradient in one Triton kernel" if kernel else ""
        return Decision(
            NAME, "auto", True, LOSS_FUSED,
            f"fused chunked LM head + cross-entropy: the full logits are never materialised{rows}",
        )
    return Decision(
        NAME, "auto", False, LOSS_PLAIN,
        f"full logits in float32: the fused loss cannot run this model ({missing})",
    )


class Loss:
    """The chosen loss: ``loss(model, batch, meta, num_items)`` on a packed micro-batch."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self._loss = LOSS_FUNCTIONS[kernel]

    def __call__(
        self, model: torch.nn.Module, batch: PackedBatch, meta: AnyPackedMetadata | None, num_items: int
    ) -> torch.Tensor:
        """Summed token loss of ``batch`` divided by ``num_items`` (the step's label count)."""
        return self._loss(model, batch, meta, num_items)

    def remove(self) -> None:
        pass

    def describe(self) -> str:
        return f"loss: {self.kernel}"


class LossKernel:
    """The ``loss`` kernel choice: the fused chunked loss, or full logits."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return supported(ctx.hw, ctx.facts)

    def decide(self, ctx: Context) -> Decision:
        return _decide(ctx.hw, ctx.facts)

    def apply(self, model: torch.nn.Module, decision: Decision, target: Target) -> Loss:
        return Loss(decision.backend or LOSS_PLAIN)


FEATURE = LossKernel()
