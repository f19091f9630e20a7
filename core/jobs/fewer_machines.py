"""What the placement needs to know of a queued multi-machine retry, from the store.

A job over several of ftq's machines that lost one goes back to the queue; it may resume on fewer
machines (core/jobs/placement.py ``may_shrink``) once the machines of its previous attempt that
are not live now have been gone ``Settings.shrink_after_s``, and it may resume only where its
newest checkpoint can be read. This module reads, per such job, its attempts' ``job_node`` rows
(every attempt writes one per machine, an attempt resumed on one machine too: worker/nodes.py),
their workers, and the newest recorded checkpoint:

    lost_since   when the last of the newest attempt's machines that is not live now stopped
                 being live (its worker's last heartbeat plus ``heartbeat_timeout_s``); None: all
                 are live. An attempt that already ran on fewer machines than ``nodes`` whose
                 machines are all live (it ended for another reason) answers "long ago": the
                 machines it lacked were gone past the grace when it started.
    storage      the ``(shared_dir, shared_id)`` that holds the newest recorded checkpoint: the
                 storage of an attempt's machine whose ``<shared_dir>/jobs/<job id>/`` the
                 checkpoint's recorded path is under (newest attempt first). Such a checkpoint
                 was written into the machines' shared directory and never uploaded, so no
                 machine outside that storage can resume from it (a remote worker finds it on no
                 API, a local one would start over); the placement keeps the retry on that
                 storage's machines. None: the checkpoint was written to ``output_dir`` (in the
                 API's store, uploaded by a remote worker), or there is none: any machine.

A job resumed from another job's checkpoint in a shared directory (core/jobs/rerun.py
``seed_checkpoint``: recorded in ``<shared_dir>/jobs/<its id>/``) has no ``job_node`` rows before
its first attempt: its storage is that of the workers whose ``shared_dir`` holds the recorded path,
when they all publish one storage id (two storages mounted at one path cannot be told apart by
the path: then none, any machine).

A retry (or such a resumed job) whose storage has no live machine waits; the reaper (worker/reaper.py
``note_storage_waits``) tells the job's event stream why, once, and the queue (core/jobs/eta.py,
``GET /v1/queue``) shows ``storage_wait``'s reason for as long as it waits.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.jobs.artifact_store import shared_job_dir
from core.jobs.models import Checkpoint, JobNode
from core.jobs.placement import Waiting, allow_shrink
from core.settings import Settings
from core.workers.models import Worker

Storage = tuple[str, str]
LONG_AGO = dt.datetime.min.replace(tzinfo=dt.UTC)


@dataclasses.dataclass(frozen=True)
class Previous:
    """What a queued multi-machine retry's earlier attempts left: see the module docstring."""

    lost_since: dt.datetime | None
    storage: Storage | None
    step: int | None
    """The newest recorded checkpoint's step (None: none)."""


def with_previous_machines(session: Session, waiting: Sequence[Waiting], settings: Settings,
                           now: dt.datetime, *, include: str | None = None) -> list[Waiting]:
    """``waiting`` with ``lost_since``, ``storage`` and ``checkpoint_step`` filled in for its
    multi-machine retries, and ``shrink`` set where the rule allows it now (``include``: a worker
    counted live whatever its heartbeat, the claimant's own)."""
    retries = {job.job_id: job.machines for job in waiting if job.machines > 1}
    found = previous_attempts(session, retries, settings, now, include=include)
    filled = [dataclasses.replace(job, lost_since=found[job.job_id].lost_since, storage=found[job.job_id].storage,
                                  checkpoint_step=found[job.job_id].step)
              if job.job_id in found else job for job in waiting]
    return allow_shrink(filled, now, settings.shrink_after_s)


def previous_attempts(session: Session, retries: Mapping[str, int], settings: Settings, now: dt.datetime,
                      *, include: str | None = None) -> dict[str, Previous]:
    """``Previous`` of each queued multi-machine job (``retries``: job id → the machines it asks
    for) that has ``job_node`` rows (a retry), or none and a recorded checkpoint (a resumed job)."""
    if not retries:
        return {}
    rows = session.execute(
        select(JobNode.job_id, JobNode.attempt, JobNode.worker_id, Worker.heartbeat_at, Worker.shared_dir,
               Worker.shared_id)
        .join(Worker, Worker.worker_id == JobNode.worker_id, isouter=True)
        .where(JobNode.job_id.in_(retries))
        .order_by(JobNode.job_id, JobNode.attempt.desc(), JobNode.node_rank)
    ).all()
    newest = select(Checkpoint.job_id, func.max(Checkpoint.step).label("step")) \
        .where(Checkpoint.job_id.in_(retries)).group_by(Checkpoint.job_id).subquery()
    checkpoints = {row.job_id: (row.step, row.path) for row in session.execute(
        select(Checkpoint.job_id, Checkpoint.step, Checkpoint.path)
        .join(newest, (newest.c.job_id == Checkpoint.job_id) & (newest.c.step == Checkpoint.step)))}
    by_job: dict[str, list[Any]] = {}
    for row in rows:
        by_job.setdefault(row.job_id, []).append(row)
    timeout = dt.timedelta(seconds=settings.heartbeat_timeout_s)
    found: dict[str, Previous] = {}
    for job_id, parts in by_job.items():
        last = [row for row in parts if row.attempt == parts[0].attempt]
        gone = [row.heartbeat_at + timeout if row.heartbeat_at is not None else LONG_AGO for row in last
                if row.worker_id != include and (row.heartbeat_at is None or row.heartbeat_at + timeout < now)]
        lost_since = max(gone) if gone else (LONG_AGO if len(last) < retries[job_id] else None)
        step, path = checkpoints.get(job_id, (None, None))
        found[job_id] = Previous(lost_since, checkpoint_storage(job_id, path, parts), step)
    for job_id, (step, path) in checkpoints.items():
        if job_id not in found:  # resumed from another job's checkpoint, not started yet
            found[job_id] = Previous(None, seeded_storage(session, job_id, path), step)
    return found


def seeded_storage(session: Session, job_id: str, path: str | None) -> Storage | None:
    """The one storage whose workers' ``<shared_dir>/jobs/<job id>/`` holds ``path`` (a resume's
    checkpoint linked there by the API host); None: none, or several at that path."""
    if not path:
        return None
    storages = {(row.shared_dir, row.shared_id) for row in session.execute(
        select(Worker.shared_dir, Worker.shared_id).where(Worker.shared_dir.is_not(None), Worker.shared_id.is_not(None))
        .distinct())
        if Path(path).is_relative_to(shared_job_dir(row.shared_dir, job_id))}
    return storages.pop() if len(storages) == 1 else None


def checkpoint_storage(job_id: str, path: str | None, parts: Sequence[Any]) -> Storage | None:
    """The storage of ``parts`` (``job_node`` rows with their worker's ``shared_dir`` and
    ``shared_id``, newest attempt first) whose job directory holds the checkpoint recorded at
    ``path``; None: it is under none of them (written to ``output_dir``), or there is none."""
    if not path:
        return None
    for row in parts:
        if row.shared_dir and row.shared_id and Path(path).is_relative_to(shared_job_dir(row.shared_dir, job_id)):
            return (row.shared_dir, row.shared_id)
    return None


def storage_wait(job: Waiting, mounted: set[Storage]) -> str | None:
    """Why ``job`` (filled by ``with_previous_machines``) cannot start whatever GPUs free up: its
    newest checkpoint is in a shared storage none of the live hosts mounts (``mounted``: their
    ``Host.shared``); None when it may start (on a live machine of that storage, or anywhere)."""
    if job.storage is None or job.storage in mounted:
        return None
    shared_dir, shared_id = job.storage
    return (f"waits for a live worker mounting the shared storage {shared_id} at {shared_dir} (FTQ_SHARED_DIR), "
            f"which holds its checkpoint step {job.checkpoint_step} in {shared_job_dir(shared_dir, job.job_id)} "
            "(never uploaded): no live worker mounts it now")
