"""What the placement's ``fewer`` rule needs to know of a queued multi-machine retry, from the store.

A job over several of ftq's machines that lost one goes back to the queue; it may resume on fewer
machines (core/jobs/placement.py ``may_shrink``) once the machines of its previous attempt that
are not live now have been gone ``Settings.shrink_after_s``. This module reads, per such job,
its newest multi-machine attempt's ``job_node`` rows and their workers:

    lost_since   when the last of those machines that is not live now stopped being live (its
                 worker's last heartbeat plus ``heartbeat_timeout_s``); None: all are live
    storage      the ``(shared_dir, shared_id)`` every one of them mounted (its checkpoints are
                 there, so a smaller retry must stay on that storage); None: not one storage

A retry that already ran on one machine wrote no ``job_node`` row, so the newest attempt over
several machines answers for it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.jobs.models import JobNode
from core.jobs.placement import Waiting, allow_shrink
from core.settings import Settings
from core.workers.models import Worker


def with_previous_machines(session: Session, waiting: Sequence[Waiting], settings: Settings,
                           now: dt.datetime, *, include: str | None = None) -> list[Waiting]:
    """``waiting`` with ``lost_since`` and ``storage`` filled in for its multi-machine retries, and
    ``shrink`` set where the rule allows it now (``include``: a worker counted live whatever its
    heartbeat, the claimant's own)."""
    retries = {job.job_id for job in waiting if job.machines > 1 and job.attempts > 0}
    if not retries:
        return list(waiting)
    rows = session.execute(
        select(JobNode.job_id, JobNode.attempt, JobNode.worker_id, Worker.heartbeat_at, Worker.shared_dir,
               Worker.shared_id)
        .join(Worker, Worker.worker_id == JobNode.worker_id, isouter=True)
        .where(JobNode.job_id.in_(retries))
    ).all()
    newest: dict[str, int] = {}
    for row in rows:
        newest[row.job_id] = max(newest.get(row.job_id, 0), row.attempt)
    timeout = dt.timedelta(seconds=settings.heartbeat_timeout_s)
    found: dict[str, tuple[dt.datetime | None, tuple[str, str] | None]] = {}
    for job_id, attempt in newest.items():
        parts = [row for row in rows if row.job_id == job_id and row.attempt == attempt]
        gone = [row.heartbeat_at + timeout if row.heartbeat_at is not None else dt.datetime.min.replace(tzinfo=dt.UTC)
                for row in parts if row.worker_id != include
                and (row.heartbeat_at is None or row.heartbeat_at + timeout < now)]
        storages = {(row.shared_dir, row.shared_id) for row in parts}
        storage = next(iter(storages)) if len(storages) == 1 and all(next(iter(storages))) else None
        found[job_id] = (max(gone) if gone else None, storage)
    filled = [dataclasses.replace(job, lost_since=found[job.job_id][0], storage=found[job.job_id][1])
              if job.job_id in found else job for job in waiting]
    return allow_shrink(filled, now, settings.shrink_after_s)
