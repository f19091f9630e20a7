from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel

from api.jobs.schemas import HeldGpu
from core.jobs.eta import QueueEntry, QueueSnapshot, RunningEntry

Shown = dict[str, tuple[bool, str | None]]
"""Per job id: whether the caller may see it, and its project's name (``core.users.access.shown_jobs``)."""


class QueuedJobOut(BaseModel):
    """A queued job; one of a project the caller is not in shows only its project, priority, GPUs,
    position and estimate (``id``, ``name``, ``owner``, ``model`` and ``waits_for`` are null)."""

    id: str | None
    name: str | None
    project: str | None = None
    position: int
    """1-based place in claim order (priority, then age)."""
    ahead: list[str | None]
    """Ids of the queued jobs before it (null for another project's)."""
    estimated_start_at: dt.datetime | None
    """Null when unknown (no live worker, or no pace to go by): see core/jobs/eta.py."""
    holds: str | None
    """The worker host whose free GPUs wait for this job (the head of the queue that fits no
    host yet; later jobs may not take them): see core/jobs/placement.py."""
    decided_by: str | None = None
    """Instead of an estimate: who starts it ("Slurm decides" for a job on a Slurm pool)."""
    waits_for: str | None = None
    """Why it waits whatever GPUs free up: a retry whose newest checkpoint is in a shared storage
    no live worker mounts names that storage's id and directory and the checkpoint's step (null
    otherwise, and on another project's job)."""
    pool: str | None = None
    priority: str
    owner: str | None
    gpus: int
    model: str | None
    created_at: dt.datetime

    @classmethod
    def of(cls, entry: QueueEntry, owners: dict[str, str], shown: Shown) -> QueuedJobOut:
        job = entry.job
        visible, project = shown.get(job.job_id, (False, None))
        out = cls(
            id=job.job_id,
            name=job.name,
            project=project,
            position=entry.position,
            ahead=[a if shown.get(a, (False,))[0] else None for a in entry.ahead],
            estimated_start_at=entry.estimated_start_at,
            holds=entry.holds,
            decided_by=entry.decided_by,
            waits_for=entry.waits_for,
            pool=job.pool,
            priority=job.priority,
            owner=owners.get(job.owner_id) if job.owner_id else None,
            gpus=job.gpus,
            model=job.model,
            created_at=job.created_at,
        )
        # waits_for names the job's directory, so it is hidden with the id
        hidden = {"id": None, "name": None, "owner": None, "model": None, "waits_for": None}
        return out if visible else out.model_copy(update=hidden)


class RunningJobOut(BaseModel):
    """A running job; one of a project the caller is not in shows no ``id`` and no ``owner``."""

    id: str | None
    project: str | None = None
    worker: str | None
    owner: str | None
    gpus: int
    held_gpus: list[HeldGpu]
    """The GPUs it holds."""
    estimated_finish_at: dt.datetime | None
    """From its remaining steps and recent pace; null when unknown."""

    @classmethod
    def of(cls, entry: RunningEntry, owners: dict[str, str], shown: Shown) -> RunningJobOut:
        visible, project = shown.get(entry.job_id, (False, None))
        return cls(
            id=entry.job_id if visible else None,
            project=project,
            worker=entry.worker_id,
            owner=owners.get(entry.owner_id) if entry.owner_id and visible else None,
            gpus=entry.gpus,
            held_gpus=[HeldGpu(worker=w, slot=s, device=d) for w, s, d in entry.held],
            estimated_finish_at=entry.estimated_finish_at,
        )


class QueueOut(BaseModel):
    object: Literal["queue"] = "queue"
    data: list[QueuedJobOut]
    """Every queued job, in claim order."""
    running: list[RunningJobOut]
    live_workers: int
    """Worker hosts with a fresh heartbeat: their GPUs are what the estimates assume (a Slurm
    bridge's pool is left out: its scheduler decides)."""
    live_gpus: int
    """GPUs of those hosts together."""
    max_running_jobs_per_user: int
    """The box's default cap on the GPUs a user's running jobs hold (0 = none); a user may have
    their own."""
    computed_at: dt.datetime

    @classmethod
    def of(cls, snap: QueueSnapshot, owners: dict[str, str], default_cap: int, shown: Shown) -> QueueOut:
        return cls(
            data=[QueuedJobOut.of(e, owners, shown) for e in snap.entries],
            running=[RunningJobOut.of(r, owners, shown) for r in snap.running],
            live_workers=snap.live_workers,
            live_gpus=snap.live_gpus,
            max_running_jobs_per_user=default_cap,
            computed_at=snap.computed_at,
        )
