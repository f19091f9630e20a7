"""Jobs whose worker vanished, and queued jobs whose message was lost.

A ``running`` job whose heartbeat is older than ``heartbeat_timeout_s`` lost its worker (killed,
machine rebooted, network cut). With attempts left (``attempts < max_attempts``) it goes back to
``queued`` and its message is sent again; the trainer then resumes from the newest checkpoint in
the job's output directory by itself. Otherwise it fails with ``worker_lost``. A job whose cancel
was requested before its worker vanished is not retried: it ends ``cancelled``. A multi-machine
job is reaped the same way when any of its machines is lost (a part not ended whose worker is
silent as long: ``worker.nodes.lost_parts``), even while its leader still beats.

Every way out of ``running`` releases the job's GPUs in the same transaction
(``core.jobs.service.transition``), so a lost worker's GPUs are free once its jobs are reaped.
GPUs still held by a job that is not running (only a hand-edited store has them) are freed too.

The broker only signals, and a signal can be lost: the embedded SQLAlchemy transport deletes a
message when a worker fetches it, so a worker killed mid-job takes the message with it, and a
submit while the broker is down commits the job but sends nothing. So each host (``host``)
also re-sends, to itself, the message of every job the queue policy places on it now that has
been ``queued`` longer than ``resend_after_s`` (and bumps its ``updated_at`` so it is re-sent at
most once per period). Such a job fits the host's free GPUs, and a host has a free task thread
per free GPU, so a message still in the broker would have been taken already. A duplicate
message is harmless: the claim is a compare-and-set.

A queued retry whose newest checkpoint is in a shared storage no live worker mounts waits for one
(core/jobs/placement.py ``storage``); each pass writes such a job a ``log`` event saying so, once
(``note_storage_waits``).

A reaped job frees GPUs and its owner's cap, so every job that can start now is signalled too
(its message may have been dropped while it could not).

Every worker runs ``reap`` every heartbeat interval (presence.py), and ``jobs.reap`` runs it
on demand. Two reapers racing are safe: each transition is a compare-and-set.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from core.db import utcnow
from core.jobs import scheduling
from core.jobs.artifact_store import shared_job_dir
from core.jobs.fewer_machines import Storage, previous_attempts
from core.jobs.placement import Placement
from core.jobs.models import Job, JobEvent
from core.jobs.service import append_events, state_event, transition
from core.jobs.states import JobStatus
from core.sessions.preemption import preempt_idle_sessions
from core.settings import Settings
from core.workers import pool
from core.workers.models import Worker
from worker.nodes import lost_parts

log = logging.getLogger(__name__)

WAITS_FOR_STORAGE = "waits_for_storage"
"""The field of the ``log`` event that says a retry waits for a machine of its checkpoints' storage."""


@dataclass
class ReapReport:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    """Stale jobs whose cancel had been requested: ended, not retried."""
    resent: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    """Idle chat sessions asked to end for a waiting job of higher priority (core/sessions/preemption.py)."""
    signalled: list[str] = field(default_factory=list)
    """Waiting jobs signalled because a reaped job freed GPUs or its owner's cap (scheduling.py)."""
    placed: list[Placement] = field(default_factory=list)
    """Where the jobs that can start after the reaping go (their messages go to those hosts)."""
    published: dict[str, int] = field(default_factory=dict)
    """job id → last event seq written, for live viewers."""


def reap(
    sessionmaker: sessionmaker[Session],
    settings: Settings,
    *,
    enqueue: Callable[[str, str | None], None],
    publish: Callable[[str, int], None] | None = None,
    host: str | None = None,
    resend_after_s: float | None = None,
    now: dt.datetime | None = None,
) -> ReapReport:
    """Retry or fail running jobs with a stale heartbeat; with ``host`` and ``resend_after_s``,
    re-send the lost messages of jobs placed on that host.

    ``enqueue(job_id, host)`` sends a message (``host`` None: to any host). Messages are sent and
    events published only after the transaction commits.
    """
    now = now or utcnow()
    report = ReapReport()
    cutoff = now - dt.timedelta(seconds=settings.heartbeat_timeout_s)
    with sessionmaker.begin() as session:
        stale = session.execute(
            select(Job.job_id, Job.attempts, Job.worker_id, Job.heartbeat_at, Job.cancel_requested)
            .outerjoin(Worker, Worker.worker_id == Job.worker_id)
            .where(Job.status == JobStatus.running.value)
            .where(or_(Job.heartbeat_at.is_(None), _silent(Job.heartbeat_at, cutoff, settings),
                       Job.job_id.in_(lost_parts(settings, now))))
            .order_by(Job.created_at)
        ).all()
        for job in stale:
            _settle_lost(session, settings, report, job, now)
        pool.release_orphans(session, reserved_before=cutoff)
        report.published.update(note_storage_waits(session, settings, now))
        report.preempted.extend(preempt_idle_sessions(session, settings))
        if report.requeued or report.failed or report.cancelled:
            report.placed.extend(scheduling.signal_targets(session, settings))
            report.signalled.extend(p.job_id for p in report.placed if p.job_id not in report.requeued)
        if host is not None and resend_after_s is not None:
            report.resent.extend(_mark_resent(session, settings, host, now - dt.timedelta(seconds=resend_after_s), now))
    hosts = {p.job_id: p.worker_id for p in report.placed}
    for job_id in report.requeued + report.signalled:
        enqueue(job_id, hosts.get(job_id))
    for job_id in report.resent:
        enqueue(job_id, host)
    if publish is not None:
        for job_id, seq in report.published.items():
            publish(job_id, seq)
    if report.preempted:
        log.info("reaper: preempted idle sessions %s for the queue's head", report.preempted)
    if report.requeued or report.failed or report.cancelled or report.resent:
        log.warning("reaper: requeued %s, failed %s, cancelled %s, re-sent %s",
                    report.requeued, report.failed, report.cancelled, report.resent)
    return report


def _settle_lost(session: Session, settings: Settings, report: ReapReport, job: Any, now: dt.datetime) -> None:
    """One running job whose worker is lost: cancelled if a cancel was asked for, else queued
    again while attempts remain, else failed ``worker_lost``; recorded on ``report``."""
    silent = (now - job.heartbeat_at).total_seconds() if job.heartbeat_at else None
    lost = f"lost worker {job.worker_id or '?'} (no heartbeat for " + (
        f"{silent:.0f}s)" if silent is not None else "ever)"
    )
    if job.cancel_requested:
        message = f"{lost} after the cancel was requested; the job is cancelled, not retried"
        if transition(session, job.job_id, JobStatus.cancelled, only_from=[JobStatus.running]):
            _record(session, report, job.job_id, state_event(JobStatus.cancelled, message=message))
            report.cancelled.append(job.job_id)
    elif job.attempts < settings.max_attempts:
        if transition(session, job.job_id, JobStatus.queued, only_from=[JobStatus.running],
                      worker_id=None, heartbeat_at=None):
            reason = (f"retrying from the last checkpoint after {lost}; "
                      f"attempt {job.attempts + 1} of {settings.max_attempts}")
            _record(session, report, job.job_id, state_event(JobStatus.queued, reason=reason))
            report.requeued.append(job.job_id)
    else:
        message = (f"{lost}; gave up after {job.attempts} attempts "
                   f"(max_attempts={settings.max_attempts})")
        if transition(session, job.job_id, JobStatus.failed, only_from=[JobStatus.running],
                      error_code="worker_lost", error_message=message):
            _record(session, report, job.job_id,
                    state_event(JobStatus.failed, error_code="worker_lost", message=message))
            report.failed.append(job.job_id)


def _silent(job_beat: Any, cutoff: dt.datetime, settings: Settings) -> Any:
    """A running job is lost when its heartbeat is older than the timeout and so is its worker's
    (the placement then counts that worker's machine as gone too, so the retry's message goes to
    a live host, not to the dead one's queue: the two heartbeats stop together when a machine
    dies, but the worker's may be up to one interval younger), or when its worker was restarted
    since (a new life of the worker beats, the job was the old one's). A job silent for twice the
    timeout is lost even while its worker still beats (a hung job thread)."""
    return or_(
        and_(job_beat < cutoff, or_(Worker.heartbeat_at.is_(None), Worker.heartbeat_at < cutoff,
                                    Worker.started_at > job_beat)),
        job_beat < cutoff - dt.timedelta(seconds=settings.heartbeat_timeout_s),
    )


def _mark_resent(session: Session, settings: Settings, host: str, waited: dt.datetime, now: dt.datetime) -> list[str]:
    """Jobs placed on ``host`` now, queued (untouched) since before ``waited``; their ``updated_at``
    is bumped so the next period does not re-send them again."""
    placed = [p.job_id for p in scheduling.schedule(session, settings, include=host).placements if p.worker_id == host]
    if not placed:
        return []
    lost = session.execute(
        select(Job.job_id)
        .where(Job.job_id.in_(placed), Job.status == JobStatus.queued.value, Job.updated_at < waited)
        .order_by(Job.created_at)
    ).scalars().all()
    if lost:
        session.execute(
            update(Job)
            .where(Job.job_id.in_(lost), Job.status == JobStatus.queued.value)
            .values(updated_at=now)
            .execution_options(synchronize_session=False)
        )
    return list(lost)


def note_storage_waits(session: Session, settings: Settings, now: dt.datetime) -> dict[str, int]:
    """A ``log`` event on each queued multi-machine retry whose checkpoints' storage no live host
    mounts (core/jobs/fewer_machines.py), saying it waits for one; once per wait (not when its
    newest event already says so). Returns ``{job_id: seq}`` of the events written."""
    retries = {job_id: nodes for job_id, nodes in session.execute(
        select(Job.job_id, Job.nodes).where(Job.status == JobStatus.queued.value, Job.nodes > 1, Job.attempts > 0,
                                            Job.pool.is_(None)))}
    found = previous_attempts(session, retries, settings, now)
    if not any(previous.storage for previous in found.values()):
        return {}
    hosts = pool.live_hosts(session, cutoff=scheduling.live_cutoff(settings, now))
    mounted = {host.shared for host in hosts if host.shared is not None}
    written: dict[str, int] = {}
    for job_id, previous in found.items():
        storage = previous.storage
        if storage is None or storage in mounted or _said(session, job_id, storage):
            continue
        shared_dir, shared_id = storage
        message = (f"waiting for a machine of the shared storage that holds its checkpoints: checkpoint step "
                   f"{previous.step} is in {shared_job_dir(shared_dir, job_id)} (storage id {shared_id}) and was "
                   "not uploaded, and no live worker mounts that storage now; the retry starts once a worker with "
                   f"FTQ_SHARED_DIR={shared_dir} on that storage is live (no attempt is spent meanwhile), or cancel "
                   "the job")
        (event,) = append_events(session, job_id, [("log", {"level": "warning", WAITS_FOR_STORAGE: list(storage),
                                                             "message": message})])
        written[job_id] = event.seq
    return written


def _said(session: Session, job_id: str, storage: Storage) -> bool:
    """Whether the job's newest event already says it waits for ``storage``. Takes the job row's
    lock first (a no-op UPDATE: PostgreSQL's row lock, SQLite's write lock), so two reapers racing
    write the notice once."""
    session.execute(update(Job).where(Job.job_id == job_id)
                    .values(last_event_seq=Job.last_event_seq, updated_at=Job.updated_at)
                    .execution_options(synchronize_session=False))
    data = session.execute(
        select(JobEvent.data).join(Job, (Job.job_id == JobEvent.job_id) & (Job.last_event_seq == JobEvent.seq))
        .where(JobEvent.job_id == job_id, JobEvent.type == "log")
    ).scalar_one_or_none()
    return isinstance(data, dict) and data.get(WAITS_FOR_STORAGE) == list(storage)


def _record(session: Session, report: ReapReport, job_id: str, event: tuple[str, dict]) -> None:
    (row,) = append_events(session, job_id, [event])
    report.published[job_id] = row.seq
