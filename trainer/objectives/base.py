"""``Objective``: what the run asks of a training method (its declaration: ``trainer.objectives.registry``).

The run (``trainer.training.train``) loads the records, builds the loss and hands both to the step; the
step (``trainer.training.step``) packs each micro-batch with ``pack``, runs the loss inside ``collecting``
(which adds the micro-batch's statistics to the step's device tensor from ``new_stats``), sums
that tensor over the ranks, copies it to the host with the loss in one transfer and, one step
late, turns the sums into the objective's step fields (``step_fields``). No hook reads a device
value: the step's only host reads stay where they were.

A schedule item (what ``load_data`` returns) has a length (its tokens, for packing and the
schedule), ``num_loss_tokens`` (its share of the step's loss denominator) and, when it packs as
several sequences (a DPO pair), ``sequences``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from trainer.config import TrainConfig
from trainer.training.flops import FlopCounter
from trainer.data.packing import PackedBatch


class Objective(Protocol):
    """A training method's hooks, one instance per run (``registry.load``)."""

    def load_data(self, config: TrainConfig, tokenizer: Any) -> tuple[list[Any], list[Any] | None]:
        """The training items and the validation items (None without a validation file).

        Raises:
            DatasetError: a record this objective cannot train on (naming the file and line).
        """

    def pack(self, items: Sequence[Any]) -> PackedBatch:
        """One packed micro-batch of ``items`` (``trainer.data.packing.pack_batch``, or a batch with extras)."""

    def build_loss(self, config: TrainConfig, model: torch.nn.Module, installed: Any, strategy: str | None) -> Any:
        """The run's ``loss(model, batch, meta, num_items) -> scalar``, which the ranks' strategy wraps;
        called once, after the plan is installed and before a weight changes.

        Raises:
            ConfigError: ``strategy`` (None, ``ddp``, ``fsdp2``) is one this objective cannot run under.
        """

    def new_stats(self, device: torch.device) -> torch.Tensor:
        """A zero float32 vector of the sums one step adds up (may be empty)."""

    def collecting(self, stats: torch.Tensor | None) -> AbstractContextManager[None]:
        """Entered around each micro-batch's loss: adds that micro-batch's statistics to ``stats``
        on the device (None: a stand-in, count nothing)."""

    def step_fields(self, sums: Sequence[float], targets: int) -> dict[str, float | None]:
        """This objective's step fields (its declaration's metrics) from the step's sums over all
        ranks and its loss denominator (host values, read one step late)."""

    def eval_accuracy(self, sums: Sequence[float], targets: int) -> float | None:
        """The ``eval`` event's accuracy from a validation pass's sums (None: not defined)."""

    def step_flops(self, counter: FlopCounter, items: Sequence[Any]) -> float:
        """Model FLOPs of one optimizer step over ``items`` (all ranks)."""
