"""Job operations shared by the API and the worker. Each takes a session; the caller commits."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, InvalidInput, NotFound, Unsupported
from core.files.models import File
from core.jobs.model_source import resolve_model
from core.jobs.models import Checkpoint, EvalMetric, Job, JobEvent, StepMetric
from core.jobs.scheduling import check_gpus, check_project
from core.jobs.spec import JobSpec
from core.jobs.states import FINISHED_STATUSES, JobStatus, sources_of
from core.jobs.trackers import allowed_trackers, check_trackers
from core.jobs.translate import to_train_config
from core.paging import page_newest_first, split_page
from core.projects.models import Project
from core.settings import Settings
from core.users.access import readable_by
from core.users.models import User
from core.users.service import Caller
from core.workers import pool
from core.workers.models import Worker
from trainer import objectives
from trainer.config import SWITCHES

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


def spec_hash(spec: JobSpec) -> str:
    """Fingerprint of a spec after defaults: two bodies that mean the same job hash alike."""
    canonical = json.dumps(spec.to_stored(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_job(
    session: Session,
    spec: JobSpec,
    *,
    settings: Settings,
    idempotency_key: str | None = None,
    owner_id: str | None = None,
    preflight: dict[str, Any] | None = None,
    project_id: str | None = None,
) -> tuple[Job, bool]:
    """Validate ``spec`` against the box and record a queued job of ``owner_id`` in
    ``project_id`` (whose files it must use); the caller commits, then enqueues.

    Returns ``(job, created)``: ``created`` is False when ``idempotency_key`` names a job made
    earlier from the same spec.

    Raises:
        Conflict: ``idempotency_key`` was used with a different spec.
        Unsupported: ``method`` is ``qlora`` and no live worker reports a CUDA GPU with
            bitsandbytes (``_check_method``).
        InvalidInput: unknown or deleted file ids, a file of the wrong purpose, a file whose
            format does not fit ``objective`` (preference files for dpo, others for sft), a model
            that cannot be resolved, or a spec the trainer's config refuses.
        Unsupported: an optimization forced ``on`` that no live worker can honour,
            ``gpus`` that no live host or the owner's cap can give (``core.jobs.scheduling.check_gpus``),
            or a tracker whose package no live worker has (``core.jobs.trackers.check_trackers``).
        InvalidInput: a tracking server or URL the box, or the job's project, does not list
            (``core.jobs.trackers.server_for``).
    """
    fingerprint = spec_hash(spec)
    if idempotency_key is not None:
        existing = _by_idempotency_key(session, idempotency_key, fingerprint)
        if existing is not None:
            return existing, False
    _check_method(session, spec, settings)
    _check_forced_switches(session, spec, settings)
    project = session.get(Project, project_id) if project_id is not None else None
    check_trackers(spec.tracking.model_dump(), _live_reports(session, settings), allowed_trackers(settings, project))
    check_gpus(session, spec.gpus, settings, owner_id=owner_id, nodes=spec.nodes)
    check_project(session, project_id, spec.gpus, spec.priority)
    train_row = usable_file(session, spec.training_file, "train", "training_file", project_id)
    _check_objective(spec.objective, train_row, "training_file")
    paths = {spec.training_file: train_row.path}
    if spec.validation_file is not None:
        validation_row = usable_file(session, spec.validation_file, "validation", "validation_file", project_id)
        _check_objective(spec.objective, validation_row, "validation_file")
        paths[spec.validation_file] = validation_row.path
    source = resolve_model(spec.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models,
                           check_hub=True)
    job_id = new_id("job")
    output_dir = settings.jobs_dir / job_id
    to_train_config(spec, job_id=job_id, files=paths, output_dir=output_dir, model_path=source.name_or_path)
    now = utcnow()
    job = Job(
        job_id=job_id,
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
        owner_id=owner_id,
        project_id=project_id,
        idempotency_key=idempotency_key,
        idempotency_hash=fingerprint if idempotency_key is not None else None,
        progress_step=0,
        total_steps=spec.hyperparameters.max_steps,
        output_dir=str(output_dir),
        preflight=preflight,
        created_at=now,
        updated_at=now,
    )
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


def _check_forced_switches(session: Session, spec: JobSpec, settings: Settings) -> None:
    """Refuse a switch forced ``on`` that no live worker's trainer can honour.

    Each worker stores ``python -m trainer detect --json`` in ``worker.hardware``; its
    ``capabilities`` map each switch (``trainer.config.SWITCHES``) to None (``on`` can run
    there) or the reason it cannot.
    A worker is live when its heartbeat is younger than ``heartbeat_timeout_s``. With no live
    worker that reported capabilities (none started yet, or an older trainer) the job is
    accepted and waits: the trainer's own plan refuses an impossible ``on`` when the job starts
    (``done`` with ``config_error``), so nothing impossible runs either way.

    Raises:
        Unsupported: some switch is ``on`` and every reporting live worker says it cannot be.
    """
    forced = [name for name in SWITCHES if getattr(spec.optimizations, name) == "on"]
    if not forced:
        return
    reports = [(worker_id, report.get("capabilities")) for worker_id, report in _live_reports(session, settings)]
    reports = [(worker_id, caps) for worker_id, caps in reports if isinstance(caps, dict)]
    if not reports:
        return
    for name in forced:
        reasons = {
            worker_id: caps.get(name, "its trainer does not know this switch")
            for worker_id, caps in reports
        }
        if any(reason is None for reason in reasons.values()):
            continue
        why = "; ".join(f"worker {worker_id}: {reason}" for worker_id, reason in sorted(reasons.items()))
        raise Unsupported(
            f"optimizations.{name}: on cannot be honoured by any live worker ({why}). "
            f"Set optimizations.{name} to auto or off",
            param=f"optimizations.{name}",
        )


def _check_method(session: Session, spec: JobSpec, settings: Settings) -> None:
    """Refuse ``method: qlora`` unless a live worker reports a CUDA GPU with bitsandbytes.

    Reads ``hardware.device`` and ``hardware.bitsandbytes`` of the ``detect --json`` report each
    worker stores (``worker.presence``), from the workers ``_check_forced_switches`` reads: those
    with a heartbeat younger than ``heartbeat_timeout_s``. Every live worker can claim a job of
    one GPU, so any one of them able to load a 4-bit base is enough. Unlike a forced switch, a
    box with no such report refuses (no live worker, or none whose detect has finished): a 4-bit
    base exists only with bitsandbytes on CUDA, so the caller gets the fix now rather than a
    queued job that can only fail at its start. A worker gains the report when it restarts.

    Raises:
        Unsupported: ``method`` is ``qlora`` and no live worker reports both.
    """
    if spec.method != "qlora":
        return
    reports = _live_reports(session, settings)
    gaps = {worker_id: _qlora_gap(report) for worker_id, report in reports}
    if any(gap is None for gap in gaps.values()):
        return
    fix = "Use method lora, or install bitsandbytes on a GPU worker (pip install 'ftq[qlora]') and restart it"
    if not gaps:
        raise Unsupported(
            "method: qlora needs a worker with a CUDA GPU and bitsandbytes; no worker is live "
            f"(none has sent a heartbeat in the last {settings.heartbeat_timeout_s:g} s). {fix}",
            param="method",
        )
    why = "; ".join(f"worker {worker_id}: {gap}" for worker_id, gap in sorted(gaps.items()))
    raise Unsupported(
        f"method: qlora needs a worker with a CUDA GPU and bitsandbytes; no live worker has both ({why}). {fix}",
        param="method",
    )


def _qlora_gap(report: dict[str, Any]) -> str | None:
    """None when a worker's report shows a CUDA device with bitsandbytes, else what it lacks."""
    hardware = report.get("hardware")
    if not isinstance(hardware, dict):
        return "no hardware report (its trainer detect failed or has not finished)"
    has_cuda = hardware.get("device") == "cuda"
    has_bnb = hardware.get("bitsandbytes") is True
    if has_cuda and has_bnb:
        return None
    missing = " or ".join(what for what, present in (("CUDA", has_cuda), ("bitsandbytes", has_bnb)) if not present)
    return f"{hardware.get('name', 'unknown device')} ({hardware.get('device', 'unknown')}) without {missing}"


def _live_reports(session: Session, settings: Settings) -> list[tuple[str, dict[str, Any]]]:
    """``(worker_id, detect report)`` of each worker whose heartbeat is younger than
    ``heartbeat_timeout_s``; a worker that registered before its detect finished has ``{}``."""
    cutoff = utcnow() - dt.timedelta(seconds=settings.heartbeat_timeout_s)
    workers = session.scalars(select(Worker).where(Worker.heartbeat_at >= cutoff).order_by(Worker.worker_id))
    return [(worker.worker_id, worker.hardware if isinstance(worker.hardware, dict) else {}) for worker in workers]


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
    / of ``owner_id`` / ``project_id`` / whose name, model or owner's name contains ``text``."""
    query = select(Job) if reader is None else select(Job).where(readable_by(reader, Job))
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


def _check_objective(objective: str, row: File, param: str) -> None:
    """The file's record format is one the objective trains on (``trainer.objectives``' formats)."""
    declared = objectives.declaration(objective)
    if row.format in declared.formats:
        return
    owner = next((d.name for d in objectives.declarations() if row.format in d.formats), None)
    fix = f"objective {objective} trains on {' or '.join(declared.formats)} records; upload such a file"
    if owner is not None:
        fix += f", or set objective to {owner}"
    raise InvalidInput(f"{param}: file {row.file_id} holds {row.format} records, but {fix}", param=param)


def usable_file(session: Session, file_id: str, purpose: str, param: str, project_id: str | None = None) -> File:
    """The file row a spec names in ``param``; InvalidInput when it is missing, of another
    purpose, or (``project_id``) of another project (said as for an unknown id)."""
    row = session.get(File, file_id)
    if row is None or row.deleted_at is not None or project_id not in (None, row.project_id):
        raise InvalidInput(f"{param}: no file {file_id!r}; upload it with POST /v1/files (purpose={purpose}) "
                           "and use its id", param=param)
    if row.purpose != purpose:
        raise InvalidInput(f"{param}: file {file_id} was uploaded with purpose={row.purpose}; upload it again with "
                           f"purpose={purpose}", param=param)
    return row
