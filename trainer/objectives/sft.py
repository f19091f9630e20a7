"""Supervised fine-tuning: token cross-entropy over the answer tokens, and the step's token accuracy.

The loss is the plan's loss kernel as installed (``trainer.features.loss.feature``: the fused chunked
cross-entropy of ``trainer.features.loss.fused``, or the full logits' plain one), each micro-batch's token
sum divided by the step's target count. Token accuracy (``trainer.objectives.token_accuracy``)
is counted by those kernels into this step's one-float statistics while they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.data.dataset import Sample, load_samples
from trainer.training.flops import FlopCounter
from trainer.objectives import token_accuracy
from trainer.data.packing import PackedBatch, pack_batch


class Sft:
    """The ``sft`` objective (``trainer.objectives.declarations.SFT``)."""

    def load_data(self, config: TrainConfig, tokenizer: Any) -> tuple[list[Sample], list[Sample] | None]:
        data = config.data
        train = load_samples(data.train_path, tokenizer, data.format, data.max_seq_len)
        if not data.validation_path:
            return train, None
        return train, load_samples(data.validation_path, tokenizer, data.format, data.max_seq_len)

    def pack(self, items: Sequence[Sample]) -> PackedBatch:
        return pack_batch(items)

    def build_loss(self, config: TrainConfig, model: torch.nn.Module, installed: Any, strategy: str | None) -> Any:
        return installed.loss

    def new_stats(self, device: torch.device) -> torch.Tensor:
        """[correct target tokens]."""
        return torch.zeros(1, dtype=torch.float32, device=device)

    def collecting(self, stats: torch.Tensor | None) -> AbstractContextManager[None]:
        return token_accuracy.counting(None if stats is None else stats[0])  # a view: counts land in ``stats``

    def step_fields(self, sums: Sequence[float], targets: int) -> dict[str, float | None]:
        return {"token_accuracy": sums[0] / max(targets, 1)}

    def eval_accuracy(self, sums: Sequence[float], targets: int) -> float | None:
        return sums[0] / max(targets, 1)

    def step_flops(self, counter: FlopCounter, items: Sequence[Any]) -> float:
        return counter.step_flops([len(item) for item in items])
