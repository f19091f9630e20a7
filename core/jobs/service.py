"""Job operations shared by the API and the worker. Each takes a session; the caller commits."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs.admission import admit
from core.jobs.generate_spec import GenerateSpec
from core.jobs.generation import admit_generation
from core.jobs.models import Checkpoint, EvalMetric, Job, JobEvent, StepMetric
from core.jobs.spec import JobSpec
from core.jobs.states import FINISHED_STATUSES, JobStatus, sources_of
from core.paging import page_newest_first, split_page
from core.settings import Settings
from core.users.access import readable_by
from core.users.models import User
from core.users.service import Caller
from core.workers import pool

MAX_METRICS_PAGE = 10_000
FINISHED_VALUES = frozenset(s.value for s in FINISHED_STATUSES)


def transition(
    session: Session,
    job_id: str,
    target: JobStatus,
    *,
    only_from: Iterable[JobStatus] | None = None,
    **values: Any,
) -> bool:
    """Move a job to ``target`` if its current status allows it; True if this call won.

    One conditional ``UPDATE ... WHERE status IN (...)``: of two processes racing for the same
    transition exactly one sees a row updated. ``only_from`` narrows the allowed sources
    (e.g. claim only from ``queued``). ``values`` are further columns to set in the same update.
    """
    sources = sources_of(target)
    if only_from is not None:
        sources = sources & frozenset(only_from)
    now = utcnow()
    values = dict(values)
    values.setdefault("updated_at", now)
    if target is JobStatus.running:
        values.setdefault("started_at", now)
    if target in FINISHED_STATUSES:
        values.setdefault("finished_at", now)
    result = session.execute(
        update(Job)
        .where(Job.job_id == job_id, Job.status.in_([s.value for s in sources]))
        .values(status=target.value, **values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 1 and target is not JobStatus.running:
        pool.release(session, job_id)
    return result.rowcount == 1


def append_events(session: Session, job_id: str, events: list[tuple[str, dict[str, Any]]]) -> list[JobEvent]:
    """Append events to a job's history with consecutive ``seq`` numbers, in one statement each.

    ``last_event_seq`` is advanced first, by one ``UPDATE ... RETURNING``: that takes the job
    row's lock on PostgreSQL and the write lock on SQLite before any seq is chosen, so
    concurrent writers (worker, API cancel) never reuse a seq, and a reader that saw seq N has
    seen every seq below it once both commit. (A ``SELECT`` first would let two SQLite writers
    read the same value: pysqlite starts the transaction only at the first write.)
    """
    if not events:
        return []
    last = session.execute(
        update(Job)
        .where(Job.job_id == job_id)
        .values(last_event_seq=Job.last_event_seq + len(events))
        .returning(Job.last_event_seq)
        .execution_options(synchronize_session=False)
    ).scalar_one() - len(events)
    rows = [
        JobEvent(job_id=job_id, seq=last + i + 1, type=type_, data=data)
        for i, (type_, data) in enumerate(events)
    ]
    session.add_all(rows)
    session.flush()
    return rows


def state_event(status: JobStatus, **extra: Any) -> tuple[str, dict[str, Any]]:
    """The ``state`` event recorded with every transition."""
    return ("state", {"status": status.value, **extra})


# --- Job lifecycle as the API drives it (create, read, list, cancel) ---------------------------


AnySpec = JobSpec | GenerateSpec
"""A training job's spec or a generation job's (``kind: generate``)."""


def admit_any(session: Session, spec: AnySpec, *, settings: Settings, owner_id: str | None, project_id: str | None,
              job_id: str) -> None:
    """``core.jobs.admission.admit`` for a training spec, ``core.jobs.generation.admit_generation`` for a
    generation spec: every check before the job is queued; writes nothing."""
    if isinstance(spec, GenerateSpec):
        admit_generation(session, spec, settings=settings, owner_id=owner_id, project_id=project_id)
    else:
        admit(session, spec, settings=settings, owner_id=owner_id, project_id=project_id, job_id=job_id)


def spec_hash(spec: AnySpec) -> str:
    """Fingerprint of a spec after defaults: two bodies that mean the same job hash alike."""
    canonical = json.dumps(spec.to_stored(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_job(
    session: Session,
    spec: AnySpec,
    *,
    settings: Settings,
    idempotency_key: str | None = None,
    owner_id: str | None = None,
    preflight: dict[str, Any] | None = None,
    project_id: str | None = None,
) -> tuple[Job, bool]:
    """Check ``spec`` against the box (``core.jobs.admission.admit``) and record a queued job of ``owner_id`` in
    ``project_id`` (whose files it must use); the caller commits, then enqueues.

    Returns ``(job, created)``: ``created`` is False when ``idempotency_key`` names a job made
    earlier from the same spec.

    Raises:
        Conflict: ``idempotency_key`` was used with a different spec.
        InvalidInput, Unsupported: whatever ``admit`` refuses.
    """
    fingerprint = spec_hash(spec)
    if idempotency_key is not None:
        existing = _by_idempotency_key(session, idempotency_key, fingerprint)
        if existing is not None:
            return existing, False
    job_id = new_id("job")
    admit_any(session, spec, settings=settings, owner_id=owner_id, project_id=project_id, job_id=job_id)
    job = _queued_job(spec, job_id, settings=settings, owner_id=owner_id, project_id=project_id, preflight=preflight)
    if idempotency_key is not None:
        job.idempotency_key, job.idempotency_hash = idempotency_key, fingerprint
    session.add(job)
    try:
        session.flush()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key committed first. Nothing but
        # reads happened in this transaction, so rolling it back loses nothing.
        session.rollback()
        if idempotency_key is None:
            raise
        existing = _by_idempotency_key(session, idempotency_key, fingerprint)
        if existing is None:
            raise
        return existing, False
    append_events(session, job_id, [state_event(JobStatus.queued)])
    session.refresh(job)
    return job, True


def _queued_job(spec: AnySpec, job_id: str, *, settings: Settings, owner_id: str | None, project_id: str | None,
                preflight: dict[str, Any] | None) -> Job:
    if isinstance(spec, GenerateSpec):
        return _queued_generation(spec, job_id, settings=settings, owner_id=owner_id, project_id=project_id,
                                  preflight=preflight)
    now = utcnow()
    return Job(
        job_id=job_id,
        kind="train",
        name=spec.name,
        status=JobStatus.queued.value,
        model=spec.model,
        method=spec.method,
        spec=spec.to_stored(),
        training_file_id=spec.training_file,
        validation_file_id=spec.validation_file,
        priority=spec.priority,
        gpus=spec.gpus,
        nodes=spec.nodes,
        pool=spec.pool,
        owner_id=owner_id,
        project_id=project_id,
        progress_step=0,
        total_steps=spec.hyperparameters.max_steps,
        output_dir=str(settings.jobs_dir / job_id),
        preflight=preflight,
        created_at=now,
        updated_at=now,
    )


def _queued_generation(spec: GenerateSpec, job_id: str, *, settings: Settings, owner_id: str | None,
                       project_id: str | None, preflight: dict[str, Any] | None) -> Job:
    now = utcnow()
    return Job(job_id=job_id, kind=spec.kind, name=spec.name, status=JobStatus.queued.value, model=spec.model,
               method=spec.kind, spec=spec.to_stored(), training_file_id=spec.prompts_file, priority=spec.priority,
               gpus=spec.gpus, nodes=1, owner_id=owner_id, project_id=project_id, progress_step=0,
               output_dir=str(settings.jobs_dir / job_id), preflight=preflight, created_at=now, updated_at=now)


def get_job(session: Session, job_id: str, *, reader: Caller | None = None) -> Job:
    """The job ``job_id``, read afresh.

    ``reader``: the caller (``core.users.access``): a job of a project they are not in (on
    ``/openai/v1``, also another user's) is NotFound exactly as an unknown id is, so its id is
    never confirmed. None: the system's own read (worker, scheduler), every job.
    """
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or (reader is not None and not reader.may_read(job.project_id, job.owner_id)):
        raise NotFound(f"no job {job_id!r}; list jobs with GET /v1/jobs", param="job_id")
    return job


def list_jobs(
    session: Session,
    *,
    statuses: Iterable[JobStatus] | None = None,
    owner_id: str | None = None,
    limit: int = 20,
    after: str | None = None,
    text: str | None = None,
    reader: Caller | None = None,
    project_id: str | None = None,
) -> tuple[list[Job], str | None]:
    """Jobs newest first that ``reader`` may read (None: all), optionally only those in ``statuses``
    / of ``owner_id`` / ``project_id`` / whose name, model or owner's name contains ``text``. Chat
    sessions (kind ``session``) are listed by ``GET /v1/sessions``, not here."""
    query = select(Job).where(Job.kind != "session")
    if reader is not None:
        query = query.where(readable_by(reader, Job))
    if project_id is not None:
        query = query.where(Job.project_id == project_id)
    if text and text.strip():
        query = query.where(_matching(text.strip()))
    if statuses:
        query = query.where(Job.status.in_([s.value for s in statuses]))
    if owner_id is not None:
        query = query.where(Job.owner_id == owner_id)
    query = page_newest_first(query, Job.created_at, Job.job_id, limit=limit, after=after)
    return split_page(list(session.scalars(query)), limit, "created_at", "job_id")


def _matching(text: str) -> Any:
    """Name, model or owner's name contains ``text``, case-insensitive (LIKE wildcards escaped)."""
    pattern = "%" + text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    owners = select(User.user_id).where(func.lower(User.name).like(pattern, escape="\\"))
    return or_(func.lower(Job.name).like(pattern, escape="\\"), func.lower(Job.model).like(pattern, escape="\\"),
               Job.owner_id.in_(owners))


def cancel_job(session: Session, job_id: str) -> tuple[Job, bool]:
    """Cancel a job; the caller commits. Returns ``(job, finished_now)``.

    A queued job is cancelled at once (``finished_now`` True) and never runs: the worker's claim
    is a compare-and-set from ``queued`` and fails. A running job gets ``cancel_requested``;
    its worker stops the trainer (checkpoint, then exit) and records ``cancelled``.

    Raises:
        NotFound: no such job.
        Conflict: the job already finished.
    """
    job = get_job(session, job_id)
    if transition(session, job_id, JobStatus.cancelled, only_from=[JobStatus.queued], cancel_requested=True):
        append_events(session, job_id, [state_event(JobStatus.cancelled, reason="cancelled while queued")])
        return get_job(session, job_id), True
    requested = session.execute(
        update(Job)
        .where(Job.job_id == job_id, Job.status == JobStatus.running.value)
        .values(cancel_requested=True, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    job = get_job(session, job_id)
    if requested.rowcount == 1:
        return job, False
    raise Conflict(
        f"job {job_id} already {job.status}; only queued or running jobs can be cancelled",
        param="job_id",
    )


def resume_stopped(session: Session, job_id: str) -> bool:
    """Queue again a job that a pause stopped (the OpenAI-compatible API's ``pause``, which ftq
    runs as a cancel: the trainer checkpoints, then exits); the caller commits, then enqueues.

    The one way out of ``cancelled``, outside ``ALLOWED_TRANSITIONS`` on purpose: only the
    caller knows the cancel was a pause. Like a retry after a lost worker, the next claim's
    trainer resumes from the newest checkpoint the store knows. The stop's ``state`` event is
    marked ``paused`` so the job's history (and SSE stream) does not end there. True if this
    call moved the job.
    """
    moved = session.execute(
        update(Job)
        .where(Job.job_id == job_id, Job.status == JobStatus.cancelled.value)
        .values(status=JobStatus.queued.value, cancel_requested=False, finished_at=None,
                error_code=None, error_message=None, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:
        return False
    stop = session.scalar(
        select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "state")
        .order_by(JobEvent.seq.desc()).limit(1)
    )
    if stop is not None:
        stop.data = {**stop.data, "paused": True}
    append_events(session, job_id, [state_event(JobStatus.queued, resumed=True)])
    return True


def resume_refused(job: Job) -> Conflict:
    """Why the paused job ``job`` cannot be queued again now (``resume_stopped`` would move nothing)."""
    stopped = "cancelled" if job.kind in ("generate", "eval") else "paused"
    return Conflict(
        f"job {job.job_id} is still stopping ({job.status}); resume it once its status reads '{stopped}'"
        if job.status == JobStatus.running.value else
        f"job {job.job_id} {job.status} before the pause took effect; there is nothing to resume",
        param="job_id",
    )


def list_metrics(
    session: Session, job_id: str, *, after_step: int = -1, limit: int = 1000, reader: Caller | None = None
) -> list[StepMetric]:
    """Step rows with ``step > after_step`` in step order (at most ``limit``)."""
    get_job(session, job_id, reader=reader)
    if not 1 <= limit <= MAX_METRICS_PAGE:
        raise InvalidInput(f"limit: must be between 1 and {MAX_METRICS_PAGE}, got {limit}", param="limit")
    query = (
        select(StepMetric)
        .where(StepMetric.job_id == job_id, StepMetric.step > after_step)
        .order_by(StepMetric.step)
        .limit(limit)
    )
    return list(session.scalars(query))


def list_evals(session: Session, job_id: str) -> list[EvalMetric]:
    """Every validation pass of a job, in step order."""
    return list(session.scalars(select(EvalMetric).where(EvalMetric.job_id == job_id).order_by(EvalMetric.step)))


def events_after(session: Session, job_id: str, after_seq: int, *, limit: int = 500) -> list[JobEvent]:
    """A job's events with ``seq > after_seq`` in seq order (at most ``limit``)."""
    query = (
        select(JobEvent)
        .where(JobEvent.job_id == job_id, JobEvent.seq > after_seq)
        .order_by(JobEvent.seq)
        .limit(limit)
    )
    return list(session.scalars(query))


def list_checkpoints(session: Session, job_id: str, *, reader: Caller | None = None) -> list[Checkpoint]:
    get_job(session, job_id, reader=reader)
    return list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))


def get_checkpoint(session: Session, job_id: str, step: int, *, reader: Caller | None = None) -> Checkpoint:
    get_job(session, job_id, reader=reader)
    row = session.get(Checkpoint, (job_id, step))
    if row is None:
        raise NotFound(
            f"job {job_id} has no checkpoint at step {step}; list them with GET /v1/jobs/{job_id}/checkpoints",
            param="step",
        )
    return row


def is_final_state_event(type_: str, data: dict[str, Any]) -> bool:
    """True for the ``state`` event that ends a job's history (and its SSE stream); a stop that
    was a pause (``resume_stopped`` marks it) does not."""
    return type_ == "state" and data.get("status") in FINISHED_VALUES and not data.get("paused")


def _by_idempotency_key(session: Session, key: str, fingerprint: str) -> Job | None:
    job = session.scalar(select(Job).where(Job.idempotency_key == key))
    if job is not None and job.idempotency_hash != fingerprint:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used for job {job.job_id} with a different body; "
            "use a new key for a new job",
            param="Idempotency-Key",
        )
    return job
