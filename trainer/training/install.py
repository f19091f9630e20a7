"""Apply a whole plan to a loaded model: ``install(model, plan) -> Installation``.

The one place that applies the features of ``trainer.features.registry.INSTALLED`` to a model,
in that order: packed attention, MoE routing, the activation policy (which layers are
checkpointed), activation offload (after peft, so the adapters are inside the recompute), the
LoRA kernel, the fused elementwise ops, the loss; each gets its own decision of the plan.
``Installation.replace_activations`` swaps the policy and the offload alone for another plan's
(the OOM ladder, ``trainer.parallel.oom_ladder``). The train loop and every bench script install
through it (a bench variant is a plan), and ``Installation.remove()`` undoes them in reverse
order, leaving the model as it was.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.data.packed_metadata import AnyPackedMetadata
from trainer.data.packing import PackedBatch
from trainer.features.registry import INSTALLED
from trainer.plan.feature import Handle, Installable, Target
from trainer.plan.types import Plan

ACTIVATIONS = ("gradient_checkpointing", "offload_activations")
"""The decisions ``replace_activations`` swaps (installed one after the other, in this order)."""


class Installation:
    """The handle of a whole plan on one model: what the step needs, and ``remove()``."""

    def __init__(self, model: torch.nn.Module, plan: Plan, activation_budget: int | None = None) -> None:
        self.plan = plan
        self._model = model
        self._target = Target(plan.device, activation_budget)
        self._installed: list[tuple[Installable, Handle]] = []
        try:
            for feature in INSTALLED:
                self._installed.append((feature, self._apply(feature, plan)))
        except BaseException:
            self.remove()  # a half-done install must not leak into the model
            raise

    def _apply(self, feature: Installable, plan: Plan) -> Handle:
        return feature.apply(self._model, plan.decision(feature.name), self._target)

    def handle(self, name: str) -> Any:
        """The handle of the feature whose decision is ``name``."""
        for feature, handle in self._installed:
            if feature.name == name:
                return handle
        raise KeyError(f"no feature installed for {name!r}")

    @property
    def attention(self) -> Any:
        """Packed attention's handle: builds each micro-batch's metadata (None without it)."""
        return self.handle("packed_metadata_cache")

    @property
    def checkpointing(self) -> Any:
        """The activation policy's handle (its ``layers``: the decoder layers it sees)."""
        return self.handle("gradient_checkpointing")

    @property
    def lora(self) -> Any:
        return self.handle("lora_kernel")

    @property
    def loss(self) -> Any:
        """The chosen loss: ``loss(model, batch, meta, num_items)``."""
        return self.handle("loss")

    @property
    def offloader(self) -> Any:
        """The ``ActivationOffloader`` on the decoder layers, or its no-op twin."""
        return self.handle("offload_activations").offloader

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Tell the pieces that keep per-step copies of weights when ``optimizer`` changes them."""
        self.lora.watch(optimizer)

    def micro_batch(
        self, batch: PackedBatch, device: torch.device
    ) -> tuple[PackedBatch, AnyPackedMetadata | None]:
        """Move ``batch`` to ``device`` and build its metadata from the host lengths (no sync)."""
        return batch.to(device, non_blocking=True), self.attention.metadata(batch.lengths, device, batch.prefixes)

    def replace_activations(self, plan: Plan) -> None:
        """Remove the activation policy and the offload, and install ``plan``'s in their place
        (the other pieces stay: neither depends on them). ``plan`` differs from ``self.plan``
        only in those decisions."""
        names = [feature.name for feature, _ in self._installed]
        at = names.index(ACTIVATIONS[0])
        assert names[at : at + len(ACTIVATIONS)] == list(ACTIVATIONS), f"installed in order {names}"
        for _, handle in reversed(self._installed[at : at + len(ACTIVATIONS)]):
            handle.remove()
        for i in range(at, at + len(ACTIVATIONS)):
            feature = self._installed[i][0]
            self._installed[i] = (feature, self._apply(feature, plan))
        self.plan = plan

    def describe(self) -> list[str]:
        """One line per installed piece, for the run's log."""
        return [line for _, h in self._installed if (line := h.describe()) is not None]

    def remove(self) -> None:
        """Undo every piece, last installed first."""
        while self._installed:
            self._installed.pop()[1].remove()


def install(model: torch.nn.Module, plan: Plan, activation_budget: int | None = None) -> Installation:
    """Apply ``plan``'s decisions to the loaded (and LoRA-wrapped) model, once.

    ``activation_budget``: tests only (``trainer.features.checkpointing.policy``'s budget probe)."""
    return Installation(model, plan, activation_budget)
