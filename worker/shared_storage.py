"""A worker machine's shared checkpoint directory (``FTQ_SHARED_DIR``): which machines share one,
and where a job's checkpoints go in it.

Two machines share a directory when they mount the same filesystem at the same absolute path.
The path alone cannot tell (every machine may have its own ``/shared``), so the directory holds a
marker file, ``.ftq-shared-storage``, with a random id written once by the first worker that
finds none; each worker reads it at start and publishes ``(shared_dir, shared_id)`` on its row
(worker/identity.py). Placement (core/jobs/placement.py) spreads a job that needs shared storage
(``method: full`` over several machines) only over machines with one equal pair, and the leader
puts ``shared_checkpoint_dir`` in job.json when every machine of a job has that pair.

    <shared_dir>/.ftq-shared-storage                 the marker: the storage's id
    <shared_dir>/jobs/<job id>/checkpoints/step-N/   the job's checkpoints, every rank's shards
    <shared_dir>/jobs/<job id>/unrecorded-checkpoints/  set aside on a retry (worker/prepare.py)
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.settings import Settings

log = logging.getLogger(__name__)

MARKER = ".ftq-shared-storage"
"""The file in a shared directory that holds its id."""


def storage_id(shared_dir: Path) -> str:
    """The id in ``shared_dir``'s marker, written first if there is none.

    The marker is written whole to a file of this process's own name and then hard-linked into
    place (atomic on NFS too), so two workers starting at once on a fresh share read one id.

    Raises:
        ValueError: ``shared_dir`` is not an absolute path to a directory this worker can write,
            or its marker is empty or not text; the message names ``FTQ_SHARED_DIR``.
    """
    if not shared_dir.is_absolute():
        raise ValueError(f"FTQ_SHARED_DIR: {str(shared_dir)!r} is not an absolute path; give the mount's path, "
                         "the same on every machine that mounts it")
    if not shared_dir.is_dir():
        raise ValueError(f"FTQ_SHARED_DIR: {shared_dir} is not a directory (is the shared filesystem mounted?)")
    marker = shared_dir / MARKER
    if not marker.exists():
        tmp = shared_dir / f"{MARKER}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            tmp.write_text(secrets.token_hex(16) + "\n")
            try:
                os.link(tmp, marker)
            except FileExistsError:
                pass  # another worker wrote it first: its id is the storage's
        except OSError as exc:
            raise ValueError(f"FTQ_SHARED_DIR: cannot write the marker {marker}: {exc}; the worker must be able "
                             "to write the shared directory (checkpoints go there)") from exc
        finally:
            tmp.unlink(missing_ok=True)
    try:
        found = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"FTQ_SHARED_DIR: cannot read the marker {marker}: {exc}") from exc
    if not found or len(found) > 64 or not found.isprintable():
        raise ValueError(f"FTQ_SHARED_DIR: the marker {marker} holds no id; remove it and restart the workers "
                         "that mount this directory (each reads it again)")
    return found


def published(settings: Settings, *, strict: bool = True) -> dict[str, str | None]:
    """The worker row's ``shared_dir`` and ``shared_id`` (both None without ``FTQ_SHARED_DIR``).

    Raises:
        ValueError: as ``storage_id`` when ``strict`` (the worker's start); otherwise a directory
            that cannot be used now (the mount went away) is logged and published as none, so
            no job that needs it is placed on this machine.
    """
    none: dict[str, str | None] = {"shared_dir": None, "shared_id": None}
    if settings.shared_dir is None:
        return none
    try:
        return {"shared_dir": str(settings.shared_dir), "shared_id": storage_id(settings.shared_dir)}
    except ValueError as exc:
        if strict:
            raise
        log.warning("%s; this machine takes no job that needs shared storage until it is fixed", exc)
        return none



def shared_home(session: Session, job_id: str, attempt: int) -> Path | None:
    """The job's directory in the storage every machine of this attempt shares (its parts'
    ``job_node`` rows, their workers' ``shared_dir`` and ``shared_id``); None for a job on one
    machine, or when any of its machines mounts none or another one."""
    from core.jobs.artifact_store import shared_job_dir
    from core.jobs.models import JobNode
    from core.workers.models import Worker

    parts = session.execute(
        select(Worker.shared_dir, Worker.shared_id)
        .select_from(JobNode).join(Worker, Worker.worker_id == JobNode.worker_id, isouter=True)
        .where(JobNode.job_id == job_id, JobNode.attempt == attempt)
    ).all()
    storages = {(row.shared_dir, row.shared_id) for row in parts}
    if len(parts) < 2 or len(storages) != 1:
        return None
    ((shared_dir, shared_id),) = storages
    return shared_job_dir(shared_dir, job_id) if shared_dir and shared_id else None


def claim_home(session: Session, job_id: str, attempt: int, worker_id: str, *, parts: int) -> Path | None:
    """The shared home of an attempt on ``parts`` machines: ``shared_home`` over several; on one
    machine (a multi-machine retry placed on fewer machines, core/jobs/placement.py ``fewer``),
    the home of the newest earlier attempt over several machines when this worker mounts that
    storage too: its checkpoints are there. None otherwise."""
    from core.jobs.models import JobNode
    from core.workers.models import Worker

    if parts > 1:
        return shared_home(session, job_id, attempt)
    earlier = session.execute(
        select(JobNode.attempt).where(JobNode.job_id == job_id, JobNode.attempt < attempt, JobNode.node_rank == 1)
        .order_by(JobNode.attempt.desc()).limit(1)
    ).scalar_one_or_none()
    home = shared_home(session, job_id, earlier) if earlier is not None else None
    if home is None:
        return None
    mine = session.execute(select(Worker.shared_dir, Worker.shared_id).where(Worker.worker_id == worker_id)).one_or_none()
    theirs = session.execute(
        select(Worker.shared_dir, Worker.shared_id).join(JobNode, JobNode.worker_id == Worker.worker_id)
        .where(JobNode.job_id == job_id, JobNode.attempt == earlier).limit(1)
    ).one_or_none()
    return home if mine is not None and theirs is not None and tuple(mine) == tuple(theirs) else None
