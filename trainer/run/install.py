"""Apply a whole plan to a loaded model: ``install(model, plan) -> Installation``.

The one place that wires the features of ``trainer.features`` onto a model, in a fixed order:
packed attention, MoE routing, the activation policy (which layers are checkpointed), activation
offload (after peft, so the adapters are inside the recompute), the LoRA kernel, the fused
elementwise ops, the loss. ``Installation.replace_activations`` swaps the policy and the offload
alone for another plan's (the OOM ladder, ``trainer.parallel.oom_ladder``). The train loop and every bench
script install through it (a bench variant is a plan), and ``Installation.remove()`` undoes them
in reverse order, leaving the model as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.features.attention import feature as attention
from trainer.features.checkpointing import policy as checkpointing
from trainer.features.fused_ops import feature as fused_ops
from trainer.features.lora_kernel import feature as lora_kernel
from trainer.features.loss import feature as loss
from trainer.features.moe import feature as moe
from trainer.features.offload import feature as offload
from trainer.plan.feature import Handle
from trainer.data.packed_metadata import AnyPackedMetadata
from trainer.data.packing import PackedBatch
from trainer.plan.types import Plan


class Installation:
    """The handle of a whole plan on one model: what the step needs, and ``remove()``."""

    def __init__(self, model: torch.nn.Module, plan: Plan, activation_budget: int | None = None) -> None:
        self.plan = plan
        self._model, self._budget = model, activation_budget
        self._handles: list[Handle] = []
        try:
            self.attention = self._add(attention.apply(model, plan.decision(attention.NAME)))
            self.moe = self._add(moe.apply(model, plan.decision(moe.NAME)))
            self.checkpointing = self._add(
                checkpointing.apply(model, plan.decision(checkpointing.NAME), activation_budget)
            )
            self.offload = self._add(
                offload.apply(model, plan.decision(offload.NAME), torch.device(plan.device))
            )
            self.lora = self._add(lora_kernel.apply(model, plan.decision(lora_kernel.NAME)))
            self._add(fused_ops.apply(model, plan.decision(fused_ops.NAME)))
            self.loss = self._add(loss.apply(model, plan.decision(loss.NAME)))
        except BaseException:
            self.remove()  # a half-done install must not leak into the model
            raise

    def _add(self, handle: Any) -> Any:
        self._handles.append(handle)
        return handle

    @property
    def offloader(self) -> Any:
        """The ``ActivationOffloader`` on the decoder layers, or its no-op twin."""
        return self.offload.offloader

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell the pieces that keep per-step copies of weights when ``optimizer`` changes them."""
        self.lora.watch(optimizer)

    def micro_batch(
        self, batch: PackedBatch, device: torch.device
    ) -> tuple[PackedBatch, AnyPackedMetadata | None]:
        """Move ``batch`` to ``device`` and build its metadata from the host lengths (no sync)."""
        return batch.to(device, non_blocking=True), self.attention.metadata(batch.lengths, device)

    def replace_activations(self, plan: Plan) -> None:
        """Remove the activation policy and the offload, and install ``plan``'s in their place
        (the other pieces stay: neither depends on them). ``plan`` differs from ``self.plan``
        only in those decisions."""
        at = self._handles.index(self.checkpointing)
        assert self._handles[at + 1] is self.offload, "the offload is installed right after the policy"
        self.offload.remove()
        self.checkpointing.remove()
        self.checkpointing = checkpointing.apply(self._model, plan.decision(checkpointing.NAME), self._budget)
        self.offload = offload.apply(self._model, plan.decision(offload.NAME), torch.device(plan.device))
        self._handles[at : at + 2] = [self.checkpointing, self.offload]
        self.plan = plan

    def describe(self) -> list[str]:
        """One line per installed piece, for the run's log."""
        return [line for h in self._handles if (line := h.describe()) is not None]

    def remove(self) -> None:
        """Undo every piece, last installed first."""
        while self._handles:
            self._handles.pop().remove()


def install(model: torch.nn.Module, plan: Plan, activation_budget: int | None = None) -> Installation:
    """Apply ``plan``'s decisions to the loaded (and LoRA-wrapped) model, once.

    ``activation_budget``: tests only (``trainer.features.checkpointing.policy``'s budget probe)."""
    return Installation(model, plan, activation_budget)
