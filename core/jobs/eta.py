"""Queue positions and estimated start times, from the running jobs' pace and the worker hosts.

Position is a waiting job's 1-based place in claim order (core/jobs/scheduling.py: priority,
then age), counting every queued job, capped or not. The start estimate replays the queue
policy (``core.jobs.placement.place``: GPU counts, one host per job, best fit, the head's hold,
the per-user cap on GPUs, the per-project quota) on the box's current state:

    pace       seconds per step of a job: the wall time spanned by its last 20 step rows over
               the steps between them (one row: its ``step_ms``)
    running    ends after (total_steps - step) x its pace; a job without a step row yet uses
               the pace of the latest job of the same model that has some
    waiting    takes total_steps x the pace of the latest job of its model that has steps, on as
               many GPUs as it asked for (a job of N GPUs takes N x grad_accum micro-batches per
               step, grad_accum on each rank: its step takes about as long as on one GPU)
    hosts      the live worker hosts (heartbeat younger than FTQ_HEARTBEAT_TIMEOUT_S) and their
               GPUs; a running job holds its GPUs until it ends
    replay     at time 0 the policy starts what it can; then at each job end (in time order) it
               runs again on the GPUs that end freed, until nothing waits or no end is known

A job on a named pool (``pool: slurm``) gets no estimate: the cluster's own scheduler starts it
(``decided_by`` says so: "Slurm decides"), and ftq knows neither its queue nor its other users.
A retry whose newest checkpoint is in a shared storage no live worker mounts gets none either
(the replay never starts it): ``waits_for`` says which storage, where, and which step it holds.

Unknown stays unknown: a job whose total_steps or pace is unknown has an unknown end, and its
GPUs are treated as busy from then on (a later estimate may only be earlier than real). A job
the replay never starts gets ``None``; with no live worker host every estimate is ``None``.
Estimates ignore jobs submitted later with a higher priority.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs.fewer_machines import storage_wait, with_previous_machines
from core.jobs.models import Job, StepMetric
from core.jobs.placement import Hold, Host, Owner, ProjectQuotas, Waiting, place
from core.jobs.scheduling import caps_of, live_cutoff, project_quotas, queued_in_claim_order
from core.jobs.states import JobStatus
from core.settings import Settings
from core.workers import pool

DECIDED_BY = {"slurm": "Slurm decides"}
"""What a queued job of a named pool shows instead of a start estimate."""
PACE_WINDOW = 20
"""Step rows a job's pace is measured over: recent enough to follow a slowdown, long enough to
smooth an evaluation or checkpoint step."""


@dataclass(frozen=True)
class Busy:
    """A running job in the replay: whose, how many GPUs where, and in how many seconds it ends
    (None: unknown). A job without ``worker_id`` holds no live host's GPUs, only its owner's cap."""

    owner_id: Owner
    ends_in_s: float | None
    gpus: int = 1
    worker_id: str | None = None
    slots: tuple[int, ...] = ()
    others: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """A multi-machine job's parts on the other live hosts: ``(worker_id, slots)`` each."""
    project_id: str | None = None
    """Its project, whose GPU quota it counts against while it runs."""

    def holds(self) -> set[tuple[str, int]]:
        """The ``(host, slot)`` pairs it holds while it runs."""
        parts = ((self.worker_id, self.slots), *self.others) if self.worker_id is not None else self.others
        return {(worker_id, slot) for worker_id, slots in parts for slot in slots}


@dataclass(frozen=True)
class QueueEntry:
    job: Waiting
    position: int
    """1-based place in claim order among the queued jobs."""
    ahead: tuple[str, ...]
    """Ids of the queued jobs before it in claim order."""
    estimated_start_at: dt.datetime | None
    holds: str | None = None
    """The worker host whose free GPUs are held for this job: the head of the queue that cannot
    start yet (core/jobs/placement.py)."""
    decided_by: str | None = None
    """Who decides its start instead of an estimate ("Slurm decides": a job on a Slurm pool)."""
    waits_for: str | None = None
    """Why it cannot start whatever GPUs free up, when that is what it waits for (a retry whose
    checkpoints are in a shared storage no live worker mounts: ``fewer_machines.storage_wait``)."""


@dataclass(frozen=True)
class RunningEntry:
    job_id: str
    worker_id: str | None
    owner_id: Owner
    estimated_finish_at: dt.datetime | None
    gpus: int = 1
    held: tuple[tuple[str, int, str | None], ...] = ()
    """The GPUs it holds: ``(worker, slot, device)`` each (device: the CUDA_VISIBLE_DEVICES name)."""


@dataclass(frozen=True)
class QueueSnapshot:
    entries: tuple[QueueEntry, ...]
    running: tuple[RunningEntry, ...]
    live_workers: int
    computed_at: dt.datetime
    live_gpus: int = 0
    """GPUs of the live worker hosts together."""
    hold: Hold | None = None

    def entry(self, job_id: str) -> QueueEntry | None:
        return next((e for e in self.entries if e.job.job_id == job_id), None)


def position(session: Session, job_id: str) -> QueueEntry | None:
    """``job_id``'s place in claim order and the jobs ahead of it, without the replay (so no
    start estimate and no hold): one query, what a submission answers. None if not queued."""
    waiting = queued_in_claim_order(session)
    for i, job in enumerate(waiting):
        if job.job_id == job_id:
            return QueueEntry(job, i + 1, tuple(w.job_id for w in waiting[:i]), None)
    return None


def replay_starts(
    hosts: Mapping[str, Sequence[int]],
    running: Iterable[Busy],
    waiting: Sequence[Waiting],
    caps: dict[Owner, int],
    durations: dict[str, float | None],
    addresses: Mapping[str, str | None] | None = None,
    quota_caps: Mapping[str | None, int] | None = None,
    pools: Mapping[str, str | None] | None = None,
    storages: Mapping[str, tuple[str, str] | None] | None = None,
) -> dict[str, float | None]:
    """Seconds from now until each waiting job starts (None: unknown), by replaying the policy.

    Args:
        hosts: each live host's slots.
        addresses: each live host's machine address (multi-machine jobs need them; default none).
        running: the running jobs (they hold their slots and their owners' caps until they end).
        waiting: queued jobs in claim order.
        caps: each waiting owner's cap on running GPUs (0 = none).
        durations: each waiting job's expected seconds (None unknown).
        quota_caps: each project's GPU quota (``ProjectQuotas.caps``; default none).
        pools: the named pool each live host serves (default none).
        storages: each live host's shared storage (``Host.shared``; default none).
    """
    jobs = list(running)
    pending = list(waiting)
    starts: dict[str, float | None] = {job.job_id: None for job in waiting}
    now = 0.0
    while pending:
        live = [b for b in jobs if b.ends_in_s is None or b.ends_in_s > now]
        held = set().union(*(b.holds() for b in live))
        state = [Host(w, tuple(slots), tuple(s for s in slots if (w, s) not in held), (addresses or {}).get(w),
                      (pools or {}).get(w), (storages or {}).get(w)) for w, slots in hosts.items()]
        used: Counter[Owner] = Counter()
        in_project: Counter[str | None] = Counter()
        for b in live:
            used[b.owner_id] += b.gpus
            in_project[b.project_id] += b.gpus
        for placed in place(pending, state, used, caps, ProjectQuotas(quota_caps or {}, in_project)).placements:
            job = next(j for j in pending if j.job_id == placed.job_id)
            pending.remove(job)
            starts[job.job_id] = now
            duration = durations.get(job.job_id)
            jobs.append(Busy(job.owner_id, None if duration is None else now + duration, job.gpus,
                             placed.worker_id, placed.slots, tuple((p.worker_id, p.slots) for p in placed.followers),
                             job.project_id))
        later = [b.ends_in_s for b in jobs if b.ends_in_s is not None and b.ends_in_s > now]
        if not later:
            break
        now = min(later)
    return starts


def snapshot(session: Session, settings: Settings, *, now: dt.datetime | None = None) -> QueueSnapshot:
    """The queue in claim order with positions and start estimates, and the running jobs' ends."""
    now = now or utcnow()
    waiting = with_previous_machines(session, queued_in_claim_order(session), settings, now)
    hosts = pool.live_hosts(session, cutoff=live_cutoff(settings, now))
    running_rows = session.execute(
        select(Job.job_id, Job.worker_id, Job.owner_id, Job.model, Job.progress_step, Job.total_steps, Job.gpus,
               Job.project_id)
        .where(Job.status == JobStatus.running.value)
        .order_by(Job.started_at)
    ).all()
    held = pool.held_by(session, [row.job_id for row in running_rows])
    live_ids = {host.worker_id for host in hosts}
    paces = _Paces(session)
    running: list[RunningEntry] = []
    busy: list[Busy] = []
    for row in running_rows:
        pace = paces.of_job(row.job_id) or paces.of_model(row.model)
        left = None if row.total_steps is None or pace is None else max(row.total_steps - row.progress_step, 0) * pace
        slots = held.get(row.job_id, [])
        parts: dict[str, tuple[int, ...]] = {}
        for s in slots:
            if s.worker_id in live_ids:
                parts[s.worker_id] = (*parts.get(s.worker_id, ()), s.slot)
        where = next(iter(parts), None)
        busy.append(Busy(row.owner_id, left, row.gpus, where, parts.pop(where, ()) if where else (), tuple(parts.items()),
                         row.project_id))
        gpus = tuple((s.worker_id, s.slot, s.device) for s in slots)
        running.append(RunningEntry(row.job_id, row.worker_id, row.owner_id, _at(now, left), row.gpus, gpus))
    durations = {
        job.job_id: None if job.total_steps is None or (pace := paces.of_model(job.model)) is None
        else job.total_steps * pace
        for job in waiting
    }
    caps = caps_of(session, {job.owner_id for job in waiting}, settings)
    quotas = project_quotas(session)
    starts = replay_starts({host.worker_id: host.slots for host in hosts}, busy, waiting, caps, durations,
                           {host.worker_id: host.address for host in hosts}, quotas.caps,
                           {host.worker_id: host.pool for host in hosts},
                           {host.worker_id: host.shared for host in hosts})
    used: Counter[Owner] = Counter()
    for b in busy:
        used[b.owner_id] += b.gpus
    hold = place(waiting, hosts, used, caps, quotas).hold
    ids = [job.job_id for job in waiting]
    mounted = {host.shared for host in hosts if host.shared is not None}
    entries = tuple(
        QueueEntry(job, i + 1, tuple(ids[:i]), None if job.pool else _at(now, starts[job.job_id]),
                   hold.worker_id if hold is not None and hold.job_id == job.job_id else None,
                   decided_by=DECIDED_BY.get(job.pool, f"pool {job.pool} decides") if job.pool else None,
                   waits_for=storage_wait(job, mounted))
        for i, job in enumerate(waiting)
    )
    own = [h for h in hosts if h.pool is None]  # a pool's slots are its scheduler's: no estimate rests on them
    return QueueSnapshot(entries, tuple(running), len(own), now, sum(h.size for h in own), hold)


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
