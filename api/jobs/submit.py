"""The API's half of the one submission path (``core.jobs.submit``): every route that makes a job
(``POST /v1/jobs``, ``/clone``, ``/resume``, ``/openai/v1/fine_tuning/jobs``) calls ``submit``.

    1. the dataset preflight (``api.jobs.preview.preflight_for``): files, model, and the dataset
       under the model's own tokenizer, in a tokenizer-pool process;
    2. ``core.jobs.submit.record`` and the commit, in one transaction (a worker thread);
    3. after the commit: wake the worker host the queue policy places the job on, and tell the
       job's viewers (Redis). If the broker is down the job stays ``queued`` for the reaper.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from anyio import to_thread
from sqlalchemy.orm import Session

from api.jobs.preview import preflight_for
from api.state import AppState
from core.jobs import live, scheduling
from core.jobs.models import Job
from core.jobs.states import JobStatus
from core.jobs.submit import SubmitRequest, record
from core.queue import enqueue_job

log = logging.getLogger(__name__)
View = TypeVar("View")


async def submit(state: AppState, request: SubmitRequest, view: Callable[[Session, Job], View]) -> tuple[View, bool]:
    """Check, record and queue ``request``'s job; ``view(session, job)`` after the commit.

    Returns ``(view, created)``: ``created`` False for an Idempotency-Key replay.

    Raises:
        InvalidInput, Forbidden, Conflict, Unsupported: the job is refused; nothing was stored.
    """
    report = await preflight_for(state, request.spec, request.caller)

    def create() -> tuple[View, str, str, int, bool]:
        with state.sessions() as session:
            job, created = record(session, request, settings=state.settings, preflight=report)
            session.commit()
            return view(session, job), job.job_id, job.status, job.last_event_seq, created

    out, job_id, status, seq, created = await to_thread.run_sync(create)
    if status == JobStatus.queued.value:
        await to_thread.run_sync(enqueue, state, job_id)
    if created:
        await notify(state, job_id, seq)
    return out, created


def enqueue(state: AppState, job_id: str) -> None:
    """Wake the host the policy places ``job_id`` on now (a job that must wait: any host), from
    the process's wake-up thread (api/jobs/wakeups.py: one queue replay for many submissions)."""
    if state.wakeups is not None:
        state.wakeups.note(job_id)
        return
    try:  # a state built by hand (tests) has no wake-up thread
        with state.sessions() as session:
            placed = [p for p in scheduling.signal_targets(session, state.settings) if p.job_id == job_id]
        enqueue_job(state.celery, job_id, placed[0].worker_id if placed else None)
    except Exception as exc:  # the broker is down: the job stays queued for the reaper
        log.warning("job %s committed but not signalled to the workers (broker: %s)", job_id, exc)


async def notify(state: AppState, job_id: str, seq: int) -> None:
    """Tell the job's live viewers (SSE, other API processes) that events up to ``seq`` exist."""
    if state.redis is None:
        return
    try:
        await state.redis.publish(live.channel(job_id), live.message(seq))
    except Exception as exc:  # viewers fall back to re-reading the store
        log.warning("could not publish job %s event %s to Redis: %s", job_id, seq, exc)
