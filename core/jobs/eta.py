"""Queue positions and estimated start times, from the running jobs' pace and the workers.

Position is a waiting job's 1-based place in claim order (core/jobs/scheduling.py: priority,
then age), counting every queued job, capped or not. The start estimate replays the scheduler
on the box's current state:

    pace       seconds per step of a job: the wall time spanned by its last 20 step rows over
               the steps between them (one row: its ``step_ms``)
    running    ends after (total_steps - step) x its pace; a job without a step row yet uses
               the pace of the latest job of the same model that has some
    waiting    takes total_steps x the pace of the latest job of its model that has steps
    slots      one per live worker (heartbeat younger than FTQ_HEARTBEAT_TIMEOUT_S): free now,
               or when the job it runs ends
    replay     the earliest free slot takes the first waiting job in claim order whose owner
               is under the cap at that time (jobs started in the replay count); if every
               waiting job is capped, the slot waits for the next job end

Unknown stays unknown: a job whose total_steps or pace is unknown has an unknown end, and its
slot is treated as busy from then on (a later estimate may only be earlier than real). When
no slot with a known free time remains, the rest of the queue gets ``None``. With no live
worker every estimate is ``None``. Estimates ignore jobs submitted later with a higher priority.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs.models import Job, StepMetric
from core.jobs.scheduling import (
    DEVICES_PER_WORKER,
    Owner,
    Waiting,
    cap_allows,
    caps_of,
    queued_in_claim_order,
)
from core.jobs.states import JobStatus
from core.settings import Settings
from core.workers.models import Worker

PACE_WINDOW = 20
"""Step rows a job's pace is measured over: recent enough to follow a slowdown, long enough to
smooth an evaluation or checkpoint step."""


@dataclass(frozen=True)
class Busy:
    """A running job in the replay: whose it is and in how many seconds it ends (None: unknown)."""

    owner_id: Owner
    ends_in_s: float | None


@dataclass(frozen=True)
class QueueEntry:
    job: Waiting
    position: int
    """1-based place in claim order among the queued jobs."""
    ahead: tuple[str, ...]
    """Ids of the queued jobs before it in claim order."""
    estimated_start_at: dt.datetime | None


@dataclass(frozen=True)
class RunningEntry:
    job_id: str
    worker_id: str | None
    owner_id: Owner
    estimated_finish_at: dt.datetime | None


@dataclass(frozen=True)
class QueueSnapshot:
    entries: tuple[QueueEntry, ...]
    running: tuple[RunningEntry, ...]
    live_workers: int
    computed_at: dt.datetime

    def entry(self, job_id: str) -> QueueEntry | None:
        return next((e for e in self.entries if e.job.job_id == job_id), None)


def replay_starts(
    slots: Sequence[float | None],
    running: Iterable[Busy],
    waiting: Sequence[Waiting],
    caps: dict[Owner, int],
    durations: dict[str, float | None],
) -> dict[str, float | None]:
    """Seconds from now until each waiting job starts (None: unknown), by replaying the scheduler.

    Args:
        slots: per live worker, seconds until it is free (0 idle; None unknown).
        running: the running jobs (they hold their owners' caps until they end).
        waiting: queued jobs in claim order.
        caps: each waiting owner's cap (0 = none).
        durations: each waiting job's expected seconds (None unknown).
    """
    free = list(slots)
    busy = list(running)
    pending = list(waiting)
    starts: dict[str, float | None] = {job.job_id: None for job in waiting}
    while pending:
        known = [i for i, t in enumerate(free) if t is not None]
        if not known:
            break
        slot = min(known, key=lambda i: free[i])  # type: ignore[arg-type, return-value]
        now = free[slot]
        assert now is not None
        pick = next((job for job in pending if _can_start(job, now, busy, caps)), None)
        if pick is None:
            later = [b.ends_in_s for b in busy if b.ends_in_s is not None and b.ends_in_s > now]
            if not later:
                break
            free[slot] = min(later)
            continue
        pending.remove(pick)
        starts[pick.job_id] = now
        duration = durations.get(pick.job_id)
        end = None if duration is None else now + duration
        busy.append(Busy(pick.owner_id, end))
        free[slot] = end
    return starts


def _can_start(job: Waiting, at: float, busy: list[Busy], caps: dict[Owner, int]) -> bool:
    if job.gpus > DEVICES_PER_WORKER:
        return False
    running = sum(1 for b in busy if b.owner_id == job.owner_id and (b.ends_in_s is None or b.ends_in_s > at))
    return cap_allows(running, caps.get(job.owner_id, 0))


def snapshot(session: Session, settings: Settings, *, now: dt.datetime | None = None) -> QueueSnapshot:
    """The queue in claim order with positions and start estimates, and the running jobs' ends."""
    now = now or utcnow()
    waiting = queued_in_claim_order(session)
    cutoff = now - dt.timedelta(seconds=settings.heartbeat_timeout_s)
    live = list(session.scalars(select(Worker.worker_id).where(Worker.heartbeat_at >= cutoff)))
    running_rows = session.execute(
        select(Job.job_id, Job.worker_id, Job.owner_id, Job.model, Job.progress_step, Job.total_steps)
        .where(Job.status == JobStatus.running.value)
        .order_by(Job.started_at)
    ).all()
    paces = _Paces(session)
    running: list[RunningEntry] = []
    busy: list[Busy] = []
    ends_by_worker: dict[str, float | None] = {}
    for row in running_rows:
        pace = paces.of_job(row.job_id) or paces.of_model(row.model)
        left = None if row.total_steps is None or pace is None else max(row.total_steps - row.progress_step, 0) * pace
        busy.append(Busy(row.owner_id, left))
        if row.worker_id is not None:
            ends_by_worker[row.worker_id] = left
        running.append(RunningEntry(row.job_id, row.worker_id, row.owner_id, _at(now, left)))
    slots = [ends_by_worker.get(worker_id, 0.0) for worker_id in live]
    durations = {
        job.job_id: None if job.total_steps is None or (pace := paces.of_model(job.model)) is None
        else job.total_steps * pace
        for job in waiting
    }
    caps = caps_of(session, {job.owner_id for job in waiting}, settings)
    starts = replay_starts(slots, busy, waiting, caps, durations)
    ids = [job.job_id for job in waiting]
    entries = tuple(
        QueueEntry(job, i + 1, tuple(ids[:i]), _at(now, starts[job.job_id])) for i, job in enumerate(waiting)
    )
    return QueueSnapshot(entries, tuple(running), len(live), now)


def _at(now: dt.datetime, seconds: float | None) -> dt.datetime | None:
    return None if seconds is None else now + dt.timedelta(seconds=seconds)


class _Paces:
    """Seconds per step of jobs and models, read once per snapshot."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._jobs: dict[str, float | None] = {}
        self._models: dict[str, float | None] = {}

    def of_job(self, job_id: str) -> float | None:
        if job_id not in self._jobs:
            rows = self._session.execute(
                select(StepMetric.step, StepMetric.time, StepMetric.step_ms)
                .where(StepMetric.job_id == job_id)
                .order_by(StepMetric.step.desc())
                .limit(PACE_WINDOW)
            ).all()
            self._jobs[job_id] = pace_of(rows)
        return self._jobs[job_id]

    def of_model(self, model: str) -> float | None:
        if model not in self._models:
            latest = self._session.execute(
                select(Job.job_id)
                .where(Job.model == model, Job.progress_step > 0, Job.started_at.is_not(None))
                .order_by(Job.started_at.desc())
                .limit(3)
            ).scalars().all()
            self._models[model] = next((p for p in map(self.of_job, latest) if p is not None), None)
        return self._models[model]


def pace_of(rows: Sequence[tuple[int, dt.datetime, float | None]]) -> float | None:
    """Seconds per step from ``(step, time, step_ms)`` rows (any order); None without data."""
    if not rows:
        return None
    first = min(rows, key=lambda r: r[0])
    last = max(rows, key=lambda r: r[0])
    if last[0] > first[0]:
        seconds = (last[1] - first[1]).total_seconds() / (last[0] - first[0])
        if seconds > 0:
            return seconds
    return last[2] / 1000.0 if last[2] else None
