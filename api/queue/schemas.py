from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel

from api.jobs.schemas import HeldGpu
from core.jobs.eta import QueueEntry, QueueSnapshot, RunningEntry


class QueuedJobOut(BaseModel):
    id: str
    name: str | None
    position: int
    """1-based place in claim order (priority, then age)."""
    ahead: list[str]
    """Ids of the queued jobs before it."""
    estimated_start_at: dt.datetime | None
    """Null when unknown (no live worker, or no pace to go by): see core/jobs/eta.py."""
    holds: str | None
    """The worker host whose free GPUs wait for this job (the head of the queue that fits no
    host yet; later jobs may not take them): see core/jobs/placement.py."""
    priority: str
    owner: str | None
    gpus: int
    model: str
    created_at: dt.datetime

    @classmethod
    def of(cls, entry: QueueEntry, owners: dict[str, str]) -> QueuedJobOut:
        job = entry.job
        return cls(
            id=job.job_id,
            name=job.name,
            position=entry.position,
            ahead=list(entry.ahead),
            estimated_start_at=entry.estimated_start_at,
            holds=entry.holds,
            priority=job.priority,
            owner=owners.get(job.owner_id) if job.owner_id else None,
            gpus=job.gpus,
            model=job.model,
            created_at=job.created_at,
        )


class RunningJobOut(BaseModel):
    id: str
    worker: str | None
    owner: str | None
    gpus: int
    held_gpus: list[HeldGpu]
    """The GPUs it holds."""
    estimated_finish_at: dt.datetime | None
    """From its remaining steps and recent pace; null when unknown."""

    @classmethod
    def of(cls, entry: RunningEntry, owners: dict[str, str]) -> RunningJobOut:
        return cls(
            id=entry.job_id,
            worker=entry.worker_id,
            owner=owners.get(entry.owner_id) if entry.owner_id else None,
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
    """Worker hosts with a fresh heartbeat: their GPUs are what the estimates assume."""
    live_gpus: int
    """GPUs of those hosts together."""
    max_running_jobs_per_user: int
    """The box's default cap on the GPUs a user's running jobs hold (0 = none); a user may have
    their own."""
    computed_at: dt.datetime

    @classmethod
    def of(cls, snap: QueueSnapshot, owners: dict[str, str], default_cap: int) -> QueueOut:
        return cls(
            data=[QueuedJobOut.of(e, owners) for e in snap.entries],
            running=[RunningJobOut.of(r, owners) for r in snap.running],
            live_workers=snap.live_workers,
            live_gpus=snap.live_gpus,
            max_running_jobs_per_user=default_cap,
            computed_at=snap.computed_at,
        )
