"""ftq's trainer: ``python -m trainer run job.json``, or ``trainer.run(config, emit)`` from Python.

Importing ``trainer`` (or ``trainer.config`` / ``trainer.events``) loads no torch: the worker
uses the config and event modules without it. ``run`` imports the training code when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.training.train import RunResult, StopFlag


def run(config: TrainConfig, emit: Any, stop: StopFlag | None = None) -> RunResult:
    """Train; see ``trainer.training.train.run``."""
    from trainer.training.train import run as _run

    return _run(config, emit, stop)


__all__ = ["run"]
