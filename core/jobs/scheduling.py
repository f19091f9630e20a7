"""Which queued job runs next: priority, then age, within each owner's cap on running jobs.

The store decides, the broker only signals. A ``jobs.run`` message wakes a worker; the worker
then claims the *next eligible* job, whichever job the message named:

    claim order   priority (high, normal, low), then created_at, then job_id
    eligible      queued, ``gpus`` within what the worker gives (one device per worker), and
                  its owner has fewer running jobs than the owner's cap
    cap           ``user.max_running_jobs``, else ``Settings.max_running_jobs_per_user``;
                  0 = no cap. Jobs without an owner share one cap, as one anonymous user.

A claim is one conditional ``UPDATE ... WHERE status = 'queued' AND <owner's running count>
< cap``, so two workers never take the same job. The count inside that statement is what
keeps the cap under races:

- SQLite has one writer: the UPDATE takes the write lock before it reads the count, so a
  second claimant's UPDATE sees the first one's running job.
- PostgreSQL runs two UPDATEs of different rows side by side, each counting from its own
  snapshot, so both could pass. The claimant first locks its owner's ``user`` row
  (``SELECT ... FOR UPDATE``; an advisory transaction lock for the anonymous owner): the
  second claimant of that owner waits until the first commits, and its UPDATE, a new
  statement under READ COMMITTED, then counts the first one's job.

A message that finds nothing eligible is dropped, so whoever frees a slot (a worker whose job
ended, the reaper failing a lost job) sends the next eligible job's message again
(``signal_targets``).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session, aliased

from core.db import utcnow
from core.errors import Unsupported
from core.jobs.models import Job
from core.jobs.states import JobStatus
from core.settings import Settings
from core.users.models import User
from core.workers.models import Worker

PRIORITIES = ("high", "normal", "low")
"""Claim order of the priorities."""
PRIORITY_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
DEVICES_PER_WORKER = 1
"""A worker process owns one device (``ftq worker --gpus`` starts one per GPU) and the trainer
trains on one device, so a job can use one GPU: see ``check_gpus``."""
ANONYMOUS_LOCK_KEY = 0x6674_7100
"""PostgreSQL advisory lock serialising claims of jobs that have no owner ('ftq\\0')."""

Owner = str | None


@dataclass(frozen=True)
class Waiting:
    """A queued job as the scheduler sees it."""

    job_id: str
    owner_id: Owner
    priority: str
    gpus: int
    model: str
    total_steps: int | None
    created_at: dt.datetime
    name: str | None = None


def claim_order() -> tuple[Any, ...]:
    """``ORDER BY`` terms of the claim order (unknown priorities sort as normal)."""
    rank = case(PRIORITY_RANK, value=Job.priority, else_=PRIORITY_RANK["normal"])
    return (rank, Job.created_at, Job.job_id)


def queued_in_claim_order(session: Session) -> list[Waiting]:
    rows = session.execute(
        select(Job.job_id, Job.owner_id, Job.priority, Job.gpus, Job.model, Job.total_steps, Job.created_at, Job.name)
        .where(Job.status == JobStatus.queued.value)
        .order_by(*claim_order())
    ).all()
    return [Waiting(*row) for row in rows]


def running_by_owner(session: Session) -> Counter[Owner]:
    rows = session.execute(
        select(Job.owner_id, func.count()).where(Job.status == JobStatus.running.value).group_by(Job.owner_id)
    ).all()
    return Counter({owner: count for owner, count in rows})


def caps_of(session: Session, owners: set[Owner], settings: Settings) -> dict[Owner, int]:
    """Each owner's cap on running jobs (0 = none): the user's own, else the box default."""
    default = settings.max_running_jobs_per_user
    named = {owner for owner in owners if owner is not None}
    overrides: dict[Owner, int | None] = {}
    if named:
        overrides = dict(session.execute(select(User.user_id, User.max_running_jobs).where(User.user_id.in_(named))).all())
    return {owner: _cap(overrides.get(owner), default) for owner in owners}


def cap_allows(running: int, cap: int) -> bool:
    return cap == 0 or running < cap


def next_eligible(
    session: Session, settings: Settings, *, devices: int = DEVICES_PER_WORKER, limit: int = 1
) -> list[str]:
    """Up to ``limit`` queued jobs that could start now, in claim order.

    Each pick counts against its owner's cap, so two picks never break it together.
    """
    waiting = queued_in_claim_order(session)
    running = running_by_owner(session)
    caps = caps_of(session, {job.owner_id for job in waiting}, settings)
    picked: list[str] = []
    for job in waiting:
        if len(picked) >= limit:
            break
        if job.gpus > devices or not cap_allows(running[job.owner_id], caps[job.owner_id]):
            continue
        picked.append(job.job_id)
        running[job.owner_id] += 1
    return picked


def signal_targets(session: Session, settings: Settings, freed: int = 1) -> list[str]:
    """The jobs to send ``jobs.run`` for after ``freed`` running jobs ended (send after commit)."""
    return next_eligible(session, settings, limit=freed) if freed > 0 else []


def try_claim(
    session: Session,
    job_id: str,
    settings: Settings,
    *,
    devices: int = DEVICES_PER_WORKER,
    values: dict[str, Any] | None = None,
) -> bool:
    """queued → running for ``job_id`` if it is still eligible; True if this call won.

    The caller commits (this holds the owner's lock on PostgreSQL until then) and should have
    done no write before in the same transaction (SQLite: see the module docstring).
    ``values`` are further columns to set (worker id, attempts, ...).
    """
    owner = session.execute(select(Job.owner_id).where(Job.job_id == job_id)).one_or_none()
    if owner is None:
        return False
    owner_id: Owner = owner[0]
    override = _lock_owner(session, owner_id)
    cap = _cap(override, settings.max_running_jobs_per_user)
    conditions = [Job.job_id == job_id, Job.status == JobStatus.queued.value, Job.gpus <= devices]
    if cap:
        other = aliased(Job)
        same_owner = other.owner_id.is_(None) if owner_id is None else other.owner_id == owner_id
        running = (
            select(func.count()).select_from(other)
            .where(other.status == JobStatus.running.value, same_owner)
            .scalar_subquery()
        )
        conditions.append(running < cap)
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(*conditions)
        .values(status=JobStatus.running.value, started_at=now, updated_at=now, **(values or {}))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def check_gpus(session: Session, gpus: int, settings: Settings) -> None:
    """Refuse a GPU count this box cannot give a job at submission.

    Raises:
        Unsupported: more devices than the box's live workers report together, or more than
            one: the trainer trains on one device (no multi-GPU training yet), so reserving
            several GPUs for a job would only leave them idle.
    """
    cutoff = utcnow() - dt.timedelta(seconds=settings.heartbeat_timeout_s)
    live = session.execute(
        select(Worker.worker_id, Worker.device).where(Worker.heartbeat_at >= cutoff).order_by(Worker.worker_id)
    ).all()
    devices = len(live) * DEVICES_PER_WORKER
    if live and gpus > devices:
        names = ", ".join(f"{row.worker_id} ({row.device})" for row in live)
        raise Unsupported(
            f"gpus: {gpus} is more than the {devices} device(s) this box's live workers report ({names}); "
            f"set gpus to at most {devices}",
            param="gpus",
        )
    if gpus > DEVICES_PER_WORKER:
        raise Unsupported(
            f"gpus: {gpus} > 1 is not supported yet: the trainer uses one GPU (no multi-GPU training); "
            "set gpus to 1",
            param="gpus",
        )


def _cap(override: int | None, default: int) -> int:
    return default if override is None else override


def _lock_owner(session: Session, owner_id: Owner) -> int | None:
    """Serialise claims of one owner on PostgreSQL; returns the owner's cap override."""
    postgres = session.get_bind().dialect.name == "postgresql"
    if owner_id is None:
        if postgres:
            session.execute(select(func.pg_advisory_xact_lock(ANONYMOUS_LOCK_KEY)))
        return None
    query = select(User.max_running_jobs).where(User.user_id == owner_id)
    if postgres:
        query = query.with_for_update()
    row = session.execute(query).one_or_none()
    return row[0] if row is not None else None
