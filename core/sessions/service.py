"""Chat sessions in the store: a job of kind ``session`` (placed, prioritised, capped and cancelled
like any job: GPU slots, the queue, projects), which model names it serves, and the trainer's
``SessionConfig`` the worker writes as its job.json.

A session serves ``spec.models``, each a base, ``job:<id>`` (a final adapter or a full fine-tune's
weights), ``job:<id>@<step>`` (a checkpoint's adapter) or ``export:<id>`` (``core.jobs.generation``
resolves them), all on one base: each adapter is loaded unmerged under its own name, so one session
answers for several tuned models of one base. ``job.preflight`` keeps ``{"adapters": {model:
name}}``, fixed when the session is made.
"""

from __future__ import annotations

from typing import Any

import hashlib

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import InvalidInput, NotFound
from core.jobs import generation
from core.jobs.models import Job
from core.jobs.scheduling import check_gpus, check_project
from core.jobs.service import append_events, get_job, state_event
from core.jobs.states import JobStatus
from core.sessions.spec import KIND, SessionSpec
from core.settings import Settings
from core.users import access
from core.users.service import Caller
from trainer.generate.session_config import BASE, SessionConfig

LIVE = (JobStatus.queued.value, JobStatus.running.value)


def create_session(session: Session, caller: Caller, spec: SessionSpec, *, settings: Settings,
                   start_key: str | None = None) -> Job:
    """Check and record a queued session; the caller commits, then wakes a worker. ``start_key``
    (``start_key_for``) makes a second session started at once for the same model a unique-key
    ``IntegrityError`` at the flush.

    Raises:
        InvalidInput: a model the project cannot use, or models of different bases.
        Unsupported, NotFound, Forbidden: the project, its quota, the box's GPUs (as a job's).
    """
    project_id = access.project_for_create(session, caller, spec.project)
    check_gpus(session, 1, settings, owner_id=caller.user_id, nodes=1)
    check_project(session, project_id, 1, spec.priority)
    adapters, base = {}, None
    for index, model in enumerate(spec.models):
        resolved = generation.resolve(session, model, settings=settings, project_id=project_id)
        if base not in (None, resolved.model):
            raise InvalidInput(f"models: {model!r} runs on {resolved.model}, {spec.models[0]!r} on {base}; a session "
                               "serves models of one base (start one session per base)", param="models")
        base = resolved.model
        adapters[model] = f"m{index}" if resolved.adapter else BASE
    job_id, now = new_id("job"), utcnow()
    job = Job(job_id=job_id, kind=KIND, name=spec.name, status=JobStatus.queued.value, model=spec.models[0],
              method=KIND, spec=spec.to_stored(), training_file_id=None, priority=spec.priority, gpus=1, nodes=1,
              owner_id=caller.user_id, project_id=project_id, progress_step=0,
              output_dir=str(settings.jobs_dir / job_id), preflight={"adapters": adapters}, created_at=now,
              updated_at=now, idempotency_key=start_key)
    session.add(job)
    session.flush()
    append_events(session, job_id, [state_event(JobStatus.queued)])
    session.refresh(job)
    return job


def find_live(session: Session, caller: Caller, model: str, project_id: str) -> Job | None:
    """The oldest queued or running session of ``project_id`` that ``caller`` reads and that serves
    ``model`` (not one being ended): of two started at once, both requests pick the same one."""
    rows = session.scalars(select(Job).where(Job.kind == KIND, Job.status.in_(LIVE), Job.project_id == project_id,
                                             access.readable_by(caller, Job), Job.cancel_requested.is_not(True))
                           .order_by(Job.created_at, Job.job_id))
    return next((job for job in rows if model in adapters_of(job)), None)


def start_key_for(session: Session, caller: Caller, model: str, project_id: str) -> str:
    """The key of the next session a chat request starts for ``model`` (``job.idempotency_key``):
    requests that find none live at once compute the same key, so the store lets one of them make it."""
    digest = hashlib.sha256(model.encode()).hexdigest()[:16]
    prefix = f"session:{project_id}:{caller.user_id}:{digest}:"
    started = session.scalar(select(func.count()).select_from(Job).where(Job.idempotency_key.startswith(prefix)))
    return f"{prefix}{started or 0}"


def adapters_of(job: Job) -> dict[str, str]:
    """``{model: adapter name}`` of a session (``BASE`` for a model served without an adapter)."""
    return dict((job.preflight or {}).get("adapters", {}))


def get_session(session: Session, job_id: str, *, reader: Caller) -> Job:
    """The session ``job_id`` if ``reader`` may read it; NotFound as for an unknown id."""
    job = get_job(session, job_id, reader=reader)
    if job.kind != KIND:
        raise NotFound(f"no session {job_id!r}; list them with GET /v1/sessions", param="session_id")
    return job


def list_sessions(session: Session, caller: Caller, *, live_only: bool = True, limit: int = 100) -> list[Job]:
    query = select(Job).where(Job.kind == KIND, access.readable_by(caller, Job))
    if live_only:
        query = query.where(Job.status.in_(LIVE))
    return list(session.scalars(query.order_by(Job.created_at.desc()).limit(limit)))


def build_session_config(session: Session, job: Job, *, settings: Settings, output_dir: str,
                         fetch: generation.Fetch | None = None) -> SessionConfig:
    """The stored session → the trainer's ``SessionConfig`` on the worker, each model resolved again
    (``fetch``: how a job's weights reach this machine, as for a generation job).

    Raises:
        InvalidInput: a model is gone (a job deleted, weights missing).
        worker.transfer.TransferError: a remote worker's download failed.
    """
    spec = SessionSpec.model_validate(job.spec)
    base, paths, tokenizer = None, {}, None
    for model, name in adapters_of(job).items():
        resolved = generation.resolve(session, model, settings=settings, project_id=job.project_id, fetch=fetch)
        # One base, so one tokenizer: None (the model's own), or a full job's base's (core.jobs.generation).
        base, tokenizer = resolved.model, resolved.tokenizer
        if resolved.adapter:
            paths[name] = resolved.adapter
    assert base is not None, f"session {job.job_id} serves no model"
    idle = spec.idle_timeout_s or settings.session_idle_timeout_s
    return SessionConfig(model=base, adapters=paths, tokenizer=tokenizer, slots=settings.session_slots,
                         max_len=settings.session_max_len, idle_timeout_s=idle,
                         drain_s=min(30.0, settings.cancel_grace_s / 2), job_id=job.job_id)


def describe(job: Job) -> dict[str, Any]:
    """A session as the native API shows it."""
    spec = job.spec or {}
    return {"id": job.job_id, "object": "session", "status": job.status, "models": list(spec.get("models", [])),
            "name": job.name, "priority": job.priority, "idle_timeout_s": spec.get("idle_timeout_s"),
            "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
            "worker_id": job.worker_id, "error_code": job.error_code, "error_message": job.error_message}
