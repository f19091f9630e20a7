"""Which queued job runs next, on which GPUs: the store's side of the queue policy.

The store decides, the broker only signals. A ``jobs.run`` message wakes a worker host; the
host then claims the job the policy gives it now, whichever job the message named:

    claim order   priority (high, normal, low; a job asks for at most its project's ceiling,
                  ``project.max_priority``, and is ordered at that when the ceiling was
                  lowered after it was queued), then created_at, then job_id
    GPUs          a job of ``gpus: N`` runs on N GPUs of ONE worker host, reserved all or none
                  (``gpu_slot`` rows, core/workers/pool.py) in the claim's transaction; a job
                  of ``nodes: M`` on N/M GPUs of each of M machines, every part reserved in the
                  one claim, which only its leader makes (worker/nodes.py)
    cap           a user's running jobs hold at most ``user.max_running_jobs`` GPUs, else
                  ``Settings.max_running_jobs_per_user`` (the names are older than multi-GPU
                  jobs; both count GPUs: a 1-GPU job counts 1); 0 = no cap. Jobs without an
                  owner share one cap, as one anonymous user.
    quota         a project's running jobs hold at most ``project.max_gpus`` GPUs (unset: no
                  quota; 0: none of its jobs starts), beside each user's cap.
    policy        ``core.jobs.placement.place`` (pure, so claims, wake-ups and start estimates
                  share it): in claim order, each job within its owner's cap takes N free GPUs
                  of one live host, the host with the fewest free GPUs where it fits (best fit)

No starvation: the first job in claim order that fits no host now (the head) holds the host,
among those with enough GPUs, that has the most free GPUs; no later job may take a free GPU of
that host, so its free GPUs only grow as its jobs end, until the head starts. Later jobs backfill
onto the other hosts' free GPUs, which the head could not use anyway. A 4-GPU job therefore waits
at most for the jobs running on its held host when it became the head, however many 1-GPU jobs
arrive after it; only a higher priority passes it. The hold is recomputed by every claim, not
stored. A job waiting for its owner's cap (and the head) also holds back that owner's later jobs,
which would otherwise take the cap it waits for.

A claim (``try_claim``) is one transaction: lock the owner, reserve the placement's GPUs (every
one still free, or the claim fails), then one conditional ``UPDATE job ... WHERE status =
'queued' AND <owner's running GPUs> + gpus <= cap``; the caller commits, or rolls back when it
lost. So two claimants never take the same job or the same GPU, and the cap holds under races:

- SQLite has one writer: the first UPDATE takes the write lock before anything is counted, so
  a second claimant's statements see the first one's reservation and running job.
- PostgreSQL: the claimant first locks its owner's ``user`` row (``SELECT ... FOR UPDATE``; an
  advisory transaction lock for the anonymous owner), then its project's row, so a second
  claimant of that owner or project waits until the first commits and then counts its job (a new
  statement under READ COMMITTED). The GPU rows are locked in slot order (pool.reserve). Every
  claimant takes owner, then project, then GPUs, then its job row: no lock cycle.

The placement itself is computed from a read of the queue just before; a claim racing another
change (a job ending, a new head) may place one job as the older state allowed. The next claim
sees the new state: the policy's promises hold from one claim to the next, not within a race.

A message that finds nothing for its host is dropped, so whoever frees GPUs (a worker whose job
ended, the reaper failing a lost job) sends a message to the host of each job that can start
now (``signal_targets``), and the API does on submission.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session, aliased

from core.db import utcnow
from core.errors import InvalidInput, Unsupported
from core.jobs.models import Job
from core.jobs.placement import Host, Owner, Placement, ProjectQuotas, Schedule, Waiting, cap_allows, place
from core.projects.models import Project
from core.jobs.states import JobStatus
from core.settings import Settings
from core.users.models import User
from core.workers import pool
from core.workers.models import GpuSlot

__all__ = [
    "Owner", "Placement", "ProjectQuotas", "Schedule", "Waiting", "cap_allows", "caps_of", "check_gpus",
    "check_project", "claim_order", "next_placement", "project_quotas", "queued_in_claim_order", "running_by_owner",
    "schedule", "signal_targets", "try_claim",
]

PRIORITIES = ("high", "normal", "low")
"""Claim order of the priorities."""
PRIORITY_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
ANONYMOUS_LOCK_KEY = 0x6674_7100
"""PostgreSQL advisory lock serialising claims of jobs that have no owner ('ftq\\0')."""


def claim_order() -> tuple[Any, ...]:
    """``ORDER BY`` terms of the claim order (unknown priorities sort as normal; a job no higher
    than its project's ceiling); the query outer-joins ``project`` on the job's project."""
    rank = case(PRIORITY_RANK, value=Job.priority, else_=PRIORITY_RANK["normal"])
    ceiling = case(PRIORITY_RANK, value=Project.max_priority, else_=PRIORITY_RANK["high"])
    return (case((ceiling > rank, ceiling), else_=rank), Job.created_at, Job.job_id)


def queued_in_claim_order(session: Session) -> list[Waiting]:
    rows = session.execute(
        select(Job.job_id, Job.owner_id, Job.priority, Job.gpus, Job.model, Job.total_steps, Job.created_at, Job.name,
               Job.nodes, Job.project_id, Job.pool, Job.method)
        .outerjoin(Project, Project.project_id == Job.project_id)
        .where(Job.status == JobStatus.queued.value)
        .order_by(*claim_order())
    ).all()
    return [Waiting(*row) for row in rows]


def project_quotas(session: Session) -> ProjectQuotas:
    """Each project's GPU quota (those that set one) and the GPUs its running jobs hold."""
    caps = dict(session.execute(select(Project.project_id, Project.max_gpus).where(Project.max_gpus.is_not(None))).all())
    rows = session.execute(select(Job.project_id, func.sum(Job.gpus))
                           .where(Job.status == JobStatus.running.value).group_by(Job.project_id)).all()
    return ProjectQuotas(caps, {project_id: int(gpus or 0) for project_id, gpus in rows})


def running_by_owner(session: Session) -> Counter[Owner]:
    """GPUs each owner's running jobs hold."""
    rows = session.execute(
        select(Job.owner_id, func.sum(Job.gpus)).where(Job.status == JobStatus.running.value).group_by(Job.owner_id)
    ).all()
    return Counter({owner: int(gpus or 0) for owner, gpus in rows})


def caps_of(session: Session, owners: set[Owner], settings: Settings) -> dict[Owner, int]:
    """Each owner's cap on running GPUs (0 = none): the user's own, else the box default."""
    default = settings.max_running_jobs_per_user
    named = {owner for owner in owners if owner is not None}
    overrides: dict[Owner, int | None] = {}
    if named:
        overrides = dict(session.execute(select(User.user_id, User.max_running_jobs).where(User.user_id.in_(named))).all())
    return {owner: _cap(overrides.get(owner), default) for owner in owners}


def live_cutoff(settings: Settings, now: dt.datetime | None = None) -> dt.datetime:
    """A worker whose heartbeat is older than this is not live."""
    return (now or utcnow()) - dt.timedelta(seconds=settings.heartbeat_timeout_s)


def schedule(session: Session, settings: Settings, *, include: str | None = None) -> Schedule:
    """The policy on the store's state now: who starts where, and the head's hold.

    ``include`` counts that host as live whatever its heartbeat (the claimant's own).
    """
    waiting = queued_in_claim_order(session)
    hosts = pool.live_hosts(session, cutoff=live_cutoff(settings), include=include)
    caps = caps_of(session, {job.owner_id for job in waiting}, settings)
    return place(waiting, hosts, running_by_owner(session), caps, project_quotas(session))


def next_placement(session: Session, settings: Settings, worker_id: str) -> Placement | None:
    """The job host ``worker_id`` should claim now, on which of its slots; None: nothing for it.

    A host whose every slot is held claims nothing, whatever the queue: it answers without
    replaying the queue (a busy host receives a wake-up for every job submitted meanwhile; the
    replay is O(queued jobs) and would run beside its own trainer, on its CPU)."""
    free = session.scalar(
        select(func.count()).select_from(GpuSlot).where(GpuSlot.worker_id == worker_id, GpuSlot.job_id.is_(None))
    )
    if not free:
        return None
    return schedule(session, settings, include=worker_id).for_host(worker_id)


def signal_targets(session: Session, settings: Settings) -> list[Placement]:
    """Every job that can start now, with its host: send each a ``jobs.run`` (after commit)."""
    return list(schedule(session, settings).placements)


def try_claim(
    session: Session,
    placement: Placement,
    settings: Settings,
    *,
    values: dict[str, Any] | None = None,
) -> bool:
    """queued → running for ``placement.job_id`` on its GPUs, if still possible; True if this won.

    The caller commits on True and must roll back on False (a reservation may be half made).
    It should have done no write before in the same transaction (SQLite: see the module
    docstring). ``values`` are further job columns to set (worker id, attempts, ...).
    """
    job = session.execute(select(Job.owner_id, Job.gpus, Job.nodes, Job.project_id, Job.pool)
                          .where(Job.job_id == placement.job_id)).one_or_none()
    if job is None or job.gpus != placement.gpus or (1 if job.pool else job.nodes) != len(placement.parts):
        return False
    owner_id: Owner = job.owner_id
    cap = _cap(_lock_owner(session, owner_id), settings.max_running_jobs_per_user)
    quota = _lock_project(session, job.project_id)
    for part in sorted(placement.parts, key=lambda p: p.worker_id):  # one lock order for every claimant
        if not pool.reserve(session, placement.job_id, part.worker_id, part.slots):
            return False
    conditions = [Job.job_id == placement.job_id, Job.status == JobStatus.queued.value]
    if cap:
        other = aliased(Job)
        same_owner = other.owner_id.is_(None) if owner_id is None else other.owner_id == owner_id
        running = (
            select(func.coalesce(func.sum(other.gpus), 0)).select_from(other)
            .where(other.status == JobStatus.running.value, same_owner)
            .scalar_subquery()
        )
        conditions.append(running + Job.gpus <= cap)
    if quota is not None:
        other = aliased(Job)
        in_project = (
            select(func.coalesce(func.sum(other.gpus), 0)).select_from(other)
            .where(other.status == JobStatus.running.value, other.project_id == job.project_id)
            .scalar_subquery()
        )
        conditions.append(in_project + Job.gpus <= quota)
    now = utcnow()
    result = session.execute(
        update(Job)
        .where(*conditions)
        # started_at is the first start: a retry or a hand-back's resume continues the same run.
        .values(status=JobStatus.running.value, started_at=func.coalesce(Job.started_at, now), updated_at=now,
                **(values or {}))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def host_sizes(session: Session, settings: Settings) -> dict[str, int]:
    """GPUs of each live ordinary worker host (not a named pool's), by worker id."""
    return {host.worker_id: host.size for host in pool.live_hosts(session, cutoff=live_cutoff(settings))
            if host.pool is None}


def check_gpus(session: Session, gpus: int, settings: Settings, *, owner_id: Owner = None, nodes: int = 1,
               pool_name: str | None = None, method: str = "lora") -> None:
    """Refuse at submission a GPU count no live host (or set of ``nodes`` machines), or the
    owner's cap, can ever give.

    With no live worker host the job is accepted and waits (nothing is known about the box yet).

    Raises:
        Unsupported: more GPUs than the largest live host has (the message lists the hosts and
            their GPU counts), fewer live machines with an address and gpus/nodes GPUs each than
            ``nodes`` (for ``method: full``, of one shared storage), or more GPUs than the owner's
            cap on running GPUs; on a named pool (``pool_name``), what
            ``core.workers.pools.check_pool`` refuses instead of the hosts' sizes.
    """
    sizes = host_sizes(session, settings)
    if pool_name is not None:
        from core.workers.pools import check_pool

        check_pool(session, pool_name, gpus=gpus, nodes=nodes)
    elif nodes > 1:
        _check_machines(session, gpus, nodes, settings, method)
    elif sizes and gpus > max(sizes.values()):
        hosts = ", ".join(f"{worker_id} ({size} GPU{'s' if size != 1 else ''})" for worker_id, size in sorted(sizes.items()))
        largest = max(sizes.values())
        raise Unsupported(
            f"gpus: {gpus} is more than any live worker host has ({hosts}); a job runs on the GPUs of "
            f"one host, so set gpus to at most {largest}",
            param="gpus",
        )
    cap = caps_of(session, {owner_id}, settings)[owner_id]
    if cap and gpus > cap:
        raise Unsupported(
            f"gpus: {gpus} is more than your cap of {cap} running GPUs (max_running_jobs); set gpus to at "
            "most that, or ask an admin to raise the cap",
            param="gpus",
        )


def check_project(session: Session, project_id: str | None, gpus: int, priority: str) -> None:
    """Refuse at submission what the job's project can never give: more GPUs than its quota, or a
    priority above its ceiling.

    Raises:
        Unsupported: ``gpus`` over ``project.max_gpus``.
        InvalidInput: ``priority`` above ``project.max_priority``.
    """
    project = session.get(Project, project_id) if project_id is not None else None
    if project is None:
        return
    if project.max_gpus is not None and gpus > project.max_gpus:
        raise Unsupported(f"gpus: {gpus} is more than project {project.name!r} may hold at once ({project.max_gpus} "
                          "GPUs, its quota); set gpus to at most that, or ask an admin to raise the quota", param="gpus")
    ceiling = project.max_priority
    if ceiling is not None and PRIORITY_RANK.get(priority, 1) < PRIORITY_RANK[ceiling]:
        raise InvalidInput(f"priority: {priority!r} is above project {project.name!r}'s ceiling {ceiling!r}; use "
                           f"{' or '.join(PRIORITIES[PRIORITY_RANK[ceiling]:])}", param="priority")


def _check_machines(session: Session, gpus: int, nodes: int, settings: Settings, method: str) -> None:
    """``nodes`` live machines (distinct addresses) with ``gpus / nodes`` GPUs each, when any host
    is live; for ``method: full``, machines of one shared storage."""
    hosts = [host for host in pool.live_hosts(session, cutoff=live_cutoff(settings)) if host.pool is None]
    if not hosts:
        return
    per_node = gpus // nodes
    if method == "full":
        _check_shared_storage(hosts, per_node, nodes)
        return
    machines = {h.address for h in hosts if h.address and h.size >= per_node}
    if len(machines) < nodes:
        listed = ", ".join(f"{h.worker_id} ({h.size} GPU{'s' if h.size != 1 else ''}, address {h.address or 'none'})"
                           for h in hosts)
        raise Unsupported(
            f"nodes: {nodes} machines with {per_node} GPU{'s' if per_node != 1 else ''} each are asked for, but "
            f"only {len(machines)} live machine(s) with an address (FTQ_WORKER_ADDRESS) have that many: {listed}; "
            "lower nodes or gpus, or start workers on more machines",
            param="nodes",
        )


def _check_shared_storage(hosts: list[Host], per_node: int, nodes: int) -> None:
    """``nodes`` live machines with ``per_node`` GPUs each that share one checkpoint directory
    (``Host.shared``), for full fine-tuning across machines.

    Refused rather than queued: with no such set of machines now the job could only wait for
    machines nobody has declared. (An empty box, no live worker, accepts it, as every check here.)
    """
    storages: dict[tuple[str, str], set[str]] = {}
    for h in hosts:
        if h.address and h.size >= per_node and h.shared is not None:
            storages.setdefault(h.shared, set()).add(h.address)
    if any(len(machines) >= nodes for machines in storages.values()):
        return
    found = "; ".join(f"{len(m)} machine(s) share {path}" for (path, _id), m in sorted(storages.items())) or \
        "no live machine declares one (FTQ_SHARED_DIR)"
    raise Unsupported(
        f"nodes: method full over {nodes} machines writes every rank's checkpoint shards into a directory all "
        f"of them share, so it needs {nodes} live machines with {per_node} GPU{'s' if per_node != 1 else ''} each "
        f"that mount one shared directory ({found}); set FTQ_SHARED_DIR on the workers of machines that mount "
        "one, or set nodes to 1, or use method lora",
        param="nodes",
    )


def _cap(override: int | None, default: int) -> int:
    return default if override is None else override


def _lock_project(session: Session, project_id: str | None) -> int | None:
    """Serialise claims of one project on PostgreSQL; returns the project's GPU quota (None: none)."""
    if project_id is None:
        return None
    query = select(Project.max_gpus).where(Project.project_id == project_id)
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update()
    row = session.execute(query).one_or_none()
    return row[0] if row is not None else None


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
