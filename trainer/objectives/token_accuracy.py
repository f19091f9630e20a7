"""Token accuracy of a training step: the fraction of its target tokens the model ranks first.

Counted on the device while the loss runs, from the logits the loss computes anyway (each chunk
of the fused loss, ``trainer.features.loss.fused``; the full logits of the plain one), into a float32
scalar of the ``sft`` objective's step statistics (``trainer.objectives.sft``) that
``trainer.training.step`` sums over micro-batches and ranks and reads one step late beside the loss, in
the same transfer: no host sync of its own. The count is a collector the step (and the validation
pass) opens around its forwards (``counting``), request-scoped like the loss' label count, so no
loss function grows a return value; outside one (DPO's log-probabilities) nothing is counted.
OpenAI reports it as ``train_mean_token_accuracy``.

Shapes: ``C`` tokens of a chunk (or row), ``V`` the vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_CORRECT: ContextVar[torch.Tensor | None] = ContextVar("ftq_correct_tokens", default=None)


def new_count(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=device)


@contextmanager
def counting(count: torch.Tensor | None) -> Iterator[None]:
    """Add the correct-token count of every loss computed inside to ``count`` (None: count nothing)."""
    token = _CORRECT.set(count)
    try:
        yield
    finally:
        _CORRECT.reset(token)


def add(logits_CV: torch.Tensor, target_C: torch.Tensor, valid_C: torch.Tensor) -> None:
    """Count the valid targets that are their row's argmax, if a step is counting (no sync)."""
    count = _CORRECT.get()
    if count is None:
        return
    with torch.no_grad():
        count += ((logits_CV.argmax(dim=-1) == target_C) & valid_C).sum()


def add_hits(hit_C: torch.Tensor) -> None:
    """Count rows already marked 1 where the target is the largest logit (0 elsewhere and on
    ignored rows), as ``trainer.kernels.cross_entropy`` reports them, if a step is counting."""
    count = _CORRECT.get()
    if count is None:
        return
    with torch.no_grad():
        count += hit_C.sum()
