"""Where a run's files go under its ``output_dir``: the one place that spells the layout.

::

    output_dir/
        checkpoints/step-NNNNNN/       a resumable checkpoint (trainer.checkpoint), step zero-padded
        checkpoints/step-NNNNNN.tmp/   one being written; renamed into place when complete
        checkpoints/step-NNNNNN/dcp/   method full / FSDP2: model + optimizer state as the ranks
                                       held it (torch.distributed.checkpoint), loadable on any
                                       number of ranks
        adapter/                       the final LoRA / QLoRA adapter (peft format)
        model/                         the final weights of method ``full``, instead of adapter/
        unrecorded-checkpoints/        checkpoints the worker set aside after a lost worker

The trainer writes it (``trainer.checkpoint``, ``trainer.train``); the worker reads it (which
checkpoints exist, ``worker.runner``) and the API serves it (``api.jobs.routes``).

Standard library only, like ``trainer.config`` and ``trainer.events``: the worker touches the
trainer only through its CLI and these three modules, so they must import without torch or
pydantic (a test imports them and asserts ``"torch" not in sys.modules``).
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
"""Directory under ``output_dir`` holding one directory per checkpoint."""
UNRECORDED_CHECKPOINTS = "unrecorded-checkpoints"
"""Directory under ``output_dir`` where the worker moves checkpoints the store never heard of."""

SHARDED_STATE = "dcp"
"""Directory inside a checkpoint holding the ``torch.distributed.checkpoint`` files."""
PARTIAL_SUFFIX = ".tmp"
"""Suffix of a checkpoint directory still being written (never resumed from)."""

_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def checkpoint_name(step: int) -> str:
    """``step-000042``: six digits at least, so names sort in step order up to a million steps."""
    return f"step-{step:06d}"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(output_dir) / checkpoint_name(step)


def partial_checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``step-000042.tmp``: where the checkpoint of ``step`` is written before it is renamed."""
    return checkpoints_dir(output_dir) / (checkpoint_name(step) + PARTIAL_SUFFIX)


def sharded_state_dir(checkpoint: str | Path) -> Path:
    """The ``torch.distributed.checkpoint`` directory of a checkpoint (method full / FSDP2)."""
    return Path(checkpoint) / SHARDED_STATE


def parse_checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint directory's name (``step-000042`` -> 42); None for any other name
    (``step-000042.tmp``, a half-written one, included)."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def export_name(method: str) -> str:
    """The final weights' directory name: ``model`` for method ``full``, else ``adapter``."""
    return "model" if method == "full" else "adapter"


def export_dir(output_dir: str | Path, method: str) -> Path:
    """Where a finished run of ``method`` leaves its trained weights (``save_pretrained`` output)."""
    return Path(output_dir) / export_name(method)


def unrecorded_checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / UNRECORDED_CHECKPOINTS
