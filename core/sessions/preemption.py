"""A waiting job of higher priority takes the GPU of an idle chat session.

When the head of the queue (``core.jobs.scheduling.schedule``'s hold) waits for GPUs of a host
where running sessions of a lower priority sit idle (no request of theirs in the relay), as many of
them as it lacks GPUs are asked to end (``cancel_requested``, as ``DELETE /v1/sessions/{id}``): each
drains and exits, its worker frees the GPU and signals the queue, and the head starts there. A busy
session is left to finish (it is taken once idle); a session never preempts another. The workers'
housekeeping runs this each heartbeat (``worker.reaper.reap``).
"""

from __future__ import annotations

from sqlalchemy import exists, func, select, update
from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs import scheduling
from core.jobs.models import Job
from core.jobs.service import append_events
from core.jobs.states import JobStatus
from core.sessions.models import SessionMessage
from core.sessions.spec import KIND
from core.settings import Settings
from core.workers.models import GpuSlot

RANK = {"low": 0, "normal": 1, "high": 2}


def preempt_idle_sessions(session: Session, settings: Settings) -> list[str]:
    """Ask the idle sessions the queue's head waits for to end; the ids asked (the caller commits)."""
    running = (Job.kind == KIND) & (Job.status == JobStatus.running.value)
    if not session.scalar(select(func.count()).select_from(Job).where(running)):
        return []
    hold = scheduling.schedule(session, settings).hold
    head = session.get(Job, hold.job_id) if hold is not None else None
    if hold is None or head is None or head.kind == KIND:
        return []
    on_hosts = (select(GpuSlot.job_id).where(GpuSlot.worker_id.in_(sorted(hold.hosts)), GpuSlot.job_id.is_not(None)))
    sessions = session.scalars(select(Job).where(running, Job.job_id.in_(on_hosts)).order_by(Job.updated_at)).all()
    short = hold.needed - hold.free - sum(1 for s in sessions if s.cancel_requested)
    busy = exists().where(SessionMessage.job_id == Job.job_id, SessionMessage.kind == "request")
    idle = set(session.scalars(select(Job.job_id).where(running, ~busy)))
    chosen = [s.job_id for s in sessions if not s.cancel_requested and s.job_id in idle
              and RANK.get(s.priority, 1) < RANK.get(head.priority, 1)][:max(short, 0)]
    for job_id in chosen:
        session.execute(update(Job).where(Job.job_id == job_id, running).values(cancel_requested=True, updated_at=utcnow())
                        .execution_options(synchronize_session=False))
        append_events(session, job_id, [("log", {"level": "info", "message": f"preempted: job {head.job_id} "
                                                 f"(priority {head.priority}) needs this GPU; ending once idle"})])
    return chosen
