"""Where a run's files go under its ``output_dir``: the one place that spells the layout.

::

    output_dir/
        checkpoints/step-NNNNNN/       a resumable checkpoint (trainer.training.checkpoint), step zero-padded
        checkpoints/step-NNNNNN.tmp/   one being written; renamed into place when complete
        checkpoints/step-NNNNNN/dcp/   method full / FSDP2: model + optimizer state as the ranks
                                       held it (torch.distributed.checkpoint), loadable on any
                                       number of ranks
        adapter/                       the final LoRA / QLoRA adapter (peft format)
        model/                         the final weights of method ``full``, instead of adapter/
        unrecorded-checkpoints/        checkpoints the worker set aside after a lost worker
        exports/<export id>/           an export's files (merged weights or a .gguf)
        job.json                       the trainer config the worker runs

A worker on another machine uploads these to the API's copy of the job directory, one
``ARTIFACT_PATHS`` entry at a time (``check_artifact_path``); the API serves nothing else from it
(no logs: a run's stderr tail is kept in the store).

The trainer writes it (``trainer.training.checkpoint``, ``trainer.training.train``); the worker reads it (which
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


JOB_CONFIG = "job.json"
"""The trainer config the worker writes into ``output_dir`` and runs."""
EXPORTS = "exports"
"""Directory under ``output_dir`` holding one directory per export."""
COMPLETIONS = "completions.jsonl"
"""A generation job's or eval run's output (``trainer.generate.job_config.COMPLETIONS``)."""
COMPLETION_PARTS = "completions.parts"
"""Its ranks' part files while it runs (``trainer.generate.job_config.PARTS``)."""
GENERATION_OUTPUTS = (COMPLETIONS, COMPLETION_PARTS)
"""The artifacts only a generation job or an eval run has (``core.workers.uploads``)."""
ARTIFACT_PATHS = (
    JOB_CONFIG,
    f"{CHECKPOINTS}/step-NNNNNN",
    "adapter",
    "model",
    f"{EXPORTS}/<export id>",
    COMPLETIONS,
    COMPLETION_PARTS,
)
"""What may be moved between a worker and the API's artifact store, relative to ``output_dir``."""

_EXPORT_ID = re.compile(r"^[a-z]{1,16}-[0-9a-f]{1,64}$")


def check_artifact_path(path: str) -> str:
    """``path`` if it names one of ``ARTIFACT_PATHS`` exactly (``checkpoints/step-000042``,
    ``exports/exp-...``), else ``ValueError`` saying which are allowed. Only plain names from
    the list pass: nothing absolute, no ``..``, no ``step-000042.tmp``, no empty part."""
    parts = path.split("/")
    allowed = (
        (len(parts) == 1 and parts[0] in (JOB_CONFIG, "adapter", "model", *GENERATION_OUTPUTS))
        or (len(parts) == 2 and parts[0] == CHECKPOINTS and parse_checkpoint_step(parts[1]) is not None
            and parts[1] == checkpoint_name(int(parts[1][5:])))
        or (len(parts) == 2 and parts[0] == EXPORTS and _EXPORT_ID.match(parts[1]) is not None)
    )
    if not allowed:
        raise ValueError(
            f"path: {path[:200]!r} is not an artifact a worker may move; use one of "
            + ", ".join(ARTIFACT_PATHS)
        )
    return path
