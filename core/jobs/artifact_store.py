"""Where the API keeps a job's files: its artifact store, ``<jobs_dir>/<job_id>/`` under the
API's own ``FTQ_DATA_DIR``, laid out as ``trainer.layout`` says.

A local worker shares the data directory, so it writes there directly. A remote worker writes
under its own data directory (the path the store's ``job.output_dir``, checkpoint and export
rows may record) and uploads each artifact here through ``PUT /v1/worker/jobs/{id}/artifacts/``.
Either way the API reads a job's files only through these functions, never from a path a worker
reported.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from core.settings import Settings
from trainer.training import layout

INCOMING = ".incoming"
"""Directory in a job's store where uploads are received and unpacked before their rename."""
LOCK = ".lock"
"""The job's store lock, in ``INCOMING`` (``job_lock``)."""


def job_store_dir(settings: Settings, job_id: str) -> Path:
    return settings.jobs_dir / job_id


def artifact_path(settings: Settings, job_id: str, path: str) -> Path:
    """``<jobs_dir>/<job_id>/<path>`` for a ``path`` that ``layout.check_artifact_path`` allows."""
    return job_store_dir(settings, job_id) / layout.check_artifact_path(path)


def incoming_dir(settings: Settings, job_id: str) -> Path:
    return job_store_dir(settings, job_id) / INCOMING


def checkpoint_store_dir(settings: Settings, job_id: str, step: int) -> Path:
    return layout.checkpoint_dir(job_store_dir(settings, job_id), step)


def shared_job_dir(shared_dir: str | Path, job_id: str) -> Path:
    """A job's directory in a shared checkpoint directory (``FTQ_SHARED_DIR``): what the worker
    writes into job.json as ``shared_checkpoint_dir``; its checkpoints are under ``checkpoints/``."""
    return Path(shared_dir) / "jobs" / job_id


def shared_checkpoint_dir(settings: Settings, job_id: str, step: int) -> Path | None:
    """The checkpoint of ``step`` in the API host's own mount of the shared directory (its
    ``FTQ_SHARED_DIR``, the path computed here, never one a worker reported); None when the API
    host mounts none or the checkpoint is not there."""
    if settings.shared_dir is None:
        return None
    job_dir = shared_job_dir(Path(settings.shared_dir).resolve(), job_id)
    found = layout.checkpoint_dir(job_dir, step)
    # Any process on a machine that mounts the directory (a job's own trainer) can write there: a
    # link for the job's directory, its checkpoints/ or the step would point the download at another
    # job's files (the containment check follows it too), so such a checkpoint is not served.
    if any(part.is_symlink() for part in (job_dir.parent, job_dir, found.parent, found)):
        return None
    return found if found.is_dir() else None


def written_to_shared(path: str | None, job_id: str, step: int, output_dir: str | None) -> bool:
    """Whether a checkpoint recorded at ``path`` was written into the shared checkpoint directory
    of the machines that ran it (``<shared>/jobs/<id>/checkpoints/step-N``, outside the run's
    ``output_dir``), which uploads none; any other path a worker reported says nothing."""
    recorded = Path(path or "/")
    shaped = recorded.parts[-4:] == ("jobs", job_id, layout.CHECKPOINTS, layout.checkpoint_name(step))
    return shaped and output_dir is not None and not recorded.is_relative_to(output_dir)


def final_store_dir(settings: Settings, job_id: str, method: str) -> Path:
    """The finished run's weights: ``adapter/``, or ``model/`` for method ``full``."""
    return layout.export_dir(job_store_dir(settings, job_id), method)


def export_store_dir(settings: Settings, job_id: str, export_id: str) -> Path:
    return job_store_dir(settings, job_id) / layout.EXPORTS / export_id


def job_config_path(settings: Settings, job_id: str) -> Path:
    return job_store_dir(settings, job_id) / layout.JOB_CONFIG


@contextlib.contextmanager
def job_lock(settings: Settings, job_id: str, *, wait: bool = True) -> Iterator[bool]:
    """Hold the job's store lock while the block runs: an upload's unpack-and-rename and the
    sweep of a finished job's store take turns on it, across API processes too. With
    ``wait=False`` the block gets False at once when another holds it (and runs unlocked:
    the caller skips its work)."""
    incoming = incoming_dir(settings, job_id)
    incoming.mkdir(parents=True, exist_ok=True)
    with (incoming / LOCK).open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def tree_bytes(path: Path, *, skip: frozenset[Path] = frozenset()) -> int:
    """Bytes of the regular files under ``path`` (or ``path`` itself), links not followed,
    the trees in ``skip`` left out; what vanishes meanwhile counts nothing."""
    total, todo = 0, [path]
    while todo:
        current = todo.pop()
        if current in skip:
            continue
        try:
            mode = current.lstat()
            if stat.S_ISDIR(mode.st_mode):
                with os.scandir(current) as entries:
                    todo.extend(Path(entry.path) for entry in entries)
            elif stat.S_ISREG(mode.st_mode):
                total += mode.st_size
        except OSError:
            continue
    return total


STALE_INCOMING_S = 3600.0
"""An upload's temporary files untouched this long belong to an upload that will never finish."""


def sweep_incoming(settings: Settings, *, older_than_s: float = STALE_INCOMING_S) -> list[Path]:
    """Remove what uploads cut off by a crash left under ``<jobs_dir>/*/.incoming/`` (the API
    removes its temporaries itself otherwise); entries younger than ``older_than_s`` may belong
    to an upload still running in another API process and are kept. Returns what was removed."""
    import shutil
    import time

    cutoff = time.time() - older_than_s
    removed: list[Path] = []
    for entry in settings.jobs_dir.glob(f"*/{INCOMING}/*"):
        if entry.name == LOCK:  # uploads and sweeps of the job take turns on it (job_lock)
            continue
        try:
            if entry.lstat().st_mtime >= cutoff:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:  # gone meanwhile, or not ours to remove: the next start tries again
            continue
    return removed
