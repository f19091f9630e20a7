"""Each worker host's pool of GPUs in the store (``gpu_slot`` rows): register, read, reserve, release.

A reservation is all or none: ``reserve`` sets ``job_id`` on every slot a claim chose only where
it is still NULL, and the claim fails (its transaction is rolled back) unless every one of them
changed. On PostgreSQL the chosen rows are first locked in slot order (``SELECT ... ORDER BY slot
FOR UPDATE``): a second claimant of an overlapping set waits for the first one's commit, then
finds the slots taken; locks taken in one order cannot deadlock. SQLite has one writer: the
UPDATE runs under the write lock.

Releasing happens in the transaction that moves the job out of ``running``
(``core.jobs.service.transition``), so a job's GPUs are free exactly when it no longer runs.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs.models import Job
from core.jobs.placement import Host
from core.jobs.states import JobStatus
from core.workers.models import GpuSlot, Worker


def register_pool(session: Session, worker_id: str, devices: Sequence[str | None]) -> None:
    """Make the worker's slots ``0..len(devices)-1`` exist with these device names; drop the rest.

    Reservations of slots that stay are kept: they belong to jobs of an earlier run of this
    worker, which the reaper retries or fails (releasing them) once their heartbeat is stale.
    The worker's row must exist (``gpu_slot.worker_id`` references it).
    """
    rows = {row.slot: row for row in session.scalars(select(GpuSlot).where(GpuSlot.worker_id == worker_id))}
    for slot, device in enumerate(devices):
        row = rows.get(slot)
        if row is None:
            session.add(GpuSlot(worker_id=worker_id, slot=slot, device=device))
        elif row.device != device:
            row.device = device
    session.execute(
        delete(GpuSlot)
        .where(GpuSlot.worker_id == worker_id, GpuSlot.slot >= len(devices))
        .execution_options(synchronize_session=False)
    )
    session.flush()


def live_hosts(session: Session, *, cutoff: dt.datetime, include: str | None = None) -> list[Host]:
    """Hosts whose heartbeat is at or after ``cutoff`` (and ``include``, the caller's own), with
    their slots and which are free, by worker id."""
    live = Worker.heartbeat_at >= cutoff
    if include is not None:
        live = live | (Worker.worker_id == include)
    rows = session.execute(
        select(GpuSlot.worker_id, GpuSlot.slot, GpuSlot.job_id, Worker.address, Worker.pool, Worker.shared_dir,
               Worker.shared_id)
        .join(Worker, Worker.worker_id == GpuSlot.worker_id)
        .where(live)
        .order_by(GpuSlot.worker_id, GpuSlot.slot)
    ).all()
    slots: dict[str, list[int]] = {}
    free: dict[str, list[int]] = {}
    address: dict[str, str | None] = {}
    pool: dict[str, str | None] = {}
    shared: dict[str, tuple[str, str] | None] = {}
    for worker_id, slot, job_id, addr, named, shared_dir, shared_id in rows:
        slots.setdefault(worker_id, []).append(slot)
        free.setdefault(worker_id, [])
        address[worker_id] = addr
        pool[worker_id] = named
        shared[worker_id] = (shared_dir, shared_id) if shared_dir and shared_id else None
        if job_id is None:
            free[worker_id].append(slot)
    return [Host(w, tuple(slots[w]), tuple(free[w]), address[w], pool[w], shared[w]) for w in sorted(slots)]


def reserve(session: Session, job_id: str, worker_id: str, slots: Sequence[int]) -> bool:
    """Give ``slots`` of ``worker_id`` to ``job_id`` if every one is free; True if all were.

    On False nothing is reserved only once the caller rolls back (some rows may have changed).
    """
    wanted = sorted(set(slots))
    where = (GpuSlot.worker_id == worker_id, GpuSlot.slot.in_(wanted), GpuSlot.job_id.is_(None))
    if session.get_bind().dialect.name == "postgresql":
        locked = session.execute(select(GpuSlot.slot).where(*where).order_by(GpuSlot.slot).with_for_update()).all()
        if len(locked) != len(wanted):
            return False
    result = session.execute(
        update(GpuSlot)
        .where(*where)
        .values(job_id=job_id, reserved_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == len(wanted)


def release(session: Session, job_id: str) -> None:
    """Free every GPU ``job_id`` holds."""
    session.execute(
        update(GpuSlot)
        .where(GpuSlot.job_id == job_id)
        .values(job_id=None, reserved_at=None)
        .execution_options(synchronize_session=False)
    )


def release_orphans(session: Session, *, reserved_before: dt.datetime) -> int:
    """Free GPUs held by a job that is not running, reserved before ``reserved_before``.

    Every path out of ``running`` releases in its own transaction, so this finds nothing unless
    a row was changed by hand. The age guard keeps it off a reservation whose claim is still
    committing (PostgreSQL re-checks only the row, not the job's status, after a lock wait).
    """
    running = select(Job.job_id).where(Job.status == JobStatus.running.value)
    result = session.execute(
        update(GpuSlot)
        .where(GpuSlot.job_id.is_not(None), GpuSlot.job_id.not_in(running), GpuSlot.reserved_at < reserved_before)
        .values(job_id=None, reserved_at=None)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount


def held_by(session: Session, job_ids: Iterable[str]) -> dict[str, list[GpuSlot]]:
    """The slots each of ``job_ids`` holds, in slot order (jobs holding none are left out)."""
    ids = list(job_ids)
    if not ids:
        return {}
    held: dict[str, list[GpuSlot]] = {}
    for row in session.scalars(
        select(GpuSlot).where(GpuSlot.job_id.in_(ids)).order_by(GpuSlot.worker_id, GpuSlot.slot)
    ):
        held.setdefault(row.job_id or "", []).append(row)
    return held


def pools(session: Session) -> dict[str, list[GpuSlot]]:
    """Every host's slots, by worker id, in slot order."""
    out: dict[str, list[GpuSlot]] = {}
    for row in session.scalars(select(GpuSlot).order_by(GpuSlot.worker_id, GpuSlot.slot)):
        out.setdefault(row.worker_id, []).append(row)
    return out
