"""One submission path for every way a job is queued: ``POST /v1/jobs``, clone (``ftq rerun``),
resume (``ftq resume``), ``/openai/v1/fine_tuning/jobs`` and its ``resume`` of a paused job. Each
entry only parses its request into ``submit(ports, spec, owner, origin)``; the checks are the
same for all of them, so a job refused at one door cannot come in by another.

    submit (here)      1. access: the owner may use the spec's files, and the project
                       2. the dataset preflight (``Ports.preflight``: the API runs it in its
                          tokenizer pool, ``api.jobs.preview.preflight_for``)
                       3. ``record`` in one transaction, then the commit
                       4. after the commit: wake a worker (``Ports.wake``), tell the job's
                          viewers (``Ports.notify``). If the broker is down the job stays
                          ``queued`` for the reaper.
    record (here)      the access check again, inside the transaction; the box's checks
                       (``core.jobs.admission.admit``); the Idempotency-Key; the new queued job
                       (``core.jobs.service.create_job``) or the paused job queued again
                       (``service.resume_stopped``); a resume's checkpoint linked in; the
                       entry's own rows (``Origin.attach``)

Nothing is written before every check passed: a refusal leaves the store as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from anyio import to_thread
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import Conflict
from core.jobs import rerun, service
from core.evals.after_training import check_job_evals
from core.jobs.generate_spec import GenerateSpec
from core.jobs.spec import JobSpec
from core.jobs.models import Checkpoint, Job
from core.jobs.service import AnySpec
from core.jobs.states import JobStatus
from core.settings import Settings
from core.users import access
from core.users.service import Caller

View = TypeVar("View")


@dataclass(frozen=True)
class Origin:
    """How a job comes in and what comes with it: all that differs between the entries."""

    idempotency_key: str | None = None
    """A repeat with the same key and spec answers the job made first."""
    resume_from: Checkpoint | None = None
    """Resume: the checkpoint (of another job) the new job starts from."""
    requeue: str | None = None
    """A paused job (the OpenAI API's pause) queued again under its own id: no new job."""
    attach: Callable[[Session, Job], None] | None = None
    """Rows the entry keeps beside the job (the OpenAI API's), written in the same transaction."""


class Ports(Protocol):
    """What a submission needs from the process it runs in (the API's: ``api.jobs.submit``)."""

    @property
    def settings(self) -> Settings: ...

    def sessions(self) -> AbstractContextManager[Session]: ...

    async def preflight(self, spec: AnySpec, owner: Caller) -> dict[str, Any]:
        """The dataset report stored on the job; raises InvalidInput where the data cannot train."""

    def wake(self, job_id: str) -> None:
        """Signal a worker that ``job_id`` is queued (committed); never raises."""

    async def notify(self, job_id: str, seq: int) -> None:
        """Tell the job's live viewers that its events up to ``seq`` exist; never raises."""


async def submit(ports: Ports, spec: AnySpec, owner: Caller, origin: Origin = Origin(), *,
                 view: Callable[[Session, Job], View]) -> tuple[View, bool]:
    """Check, record and queue ``spec``'s job for ``owner``; ``view(session, job)`` after the commit.

    Returns ``(view, queued)``: ``queued`` is False for an Idempotency-Key replay (nothing was
    written, nobody is woken).

    Raises:
        InvalidInput, Forbidden, Conflict, Unsupported, NotFound: the job is refused; nothing was stored.
    """
    await to_thread.run_sync(_check_access, ports, spec, owner)
    report = await ports.preflight(spec, owner)

    def create() -> tuple[View, str, str, int, bool]:
        with ports.sessions() as session:
            job, queued = record(session, spec, owner, origin, settings=ports.settings, preflight=report)
            session.commit()
            return view(session, job), job.job_id, job.status, job.last_event_seq, queued

    out, job_id, status, seq, queued = await to_thread.run_sync(create)
    if status == JobStatus.queued.value:  # a replay of a queued job: wake again, harmless
        await to_thread.run_sync(ports.wake, job_id)
    if queued:
        await ports.notify(job_id, seq)
    return out, queued


def record(session: Session, spec: AnySpec, owner: Caller, origin: Origin, *, settings: Settings,
           preflight: dict[str, Any] | None) -> tuple[Job, bool]:
    """Check ``spec`` against the box and queue its job; the caller commits, then enqueues.

    ``preflight``: the dataset report the caller computed, stored on a new job. Returns
    ``(job, queued)``; ``queued`` is False for an Idempotency-Key replay (nothing else is added then).

    Raises:
        Forbidden: the owner may not use a file the spec names.
        Conflict: the Idempotency-Key was used with another spec, or by another user; the job
            to queue again is no longer paused.
        InvalidInput, Unsupported: whatever ``core.jobs.admission.admit`` refuses.
    """
    access.require_usable_files(session, owner, _files(spec))
    if isinstance(spec, JobSpec) and spec.evals and origin.requeue is None:
        check_job_evals(session, owner, spec, settings=settings)
    if origin.requeue is not None:
        job = _requeue(session, spec, origin.requeue, settings=settings)
    else:
        job, created = _create(session, spec, owner, origin.idempotency_key, settings=settings, preflight=preflight)
        if not created:
            return job, False
        if origin.resume_from is not None:
            _continue_from(session, job, origin.resume_from, settings=settings)
    if origin.attach is not None:
        origin.attach(session, job)
    return job, True


def _check_access(ports: Ports, spec: AnySpec, owner: Caller) -> None:
    with ports.sessions() as session:
        access.require_usable_files(session, owner, _files(spec))
        access.project_for_create(session, owner, spec.project)


def _files(spec: AnySpec) -> dict[str, str | None]:
    if isinstance(spec, GenerateSpec):
        return {"prompts_file": spec.prompts_file}
    return {"training_file": spec.training_file, "validation_file": spec.validation_file}


def _create(session: Session, spec: AnySpec, owner: Caller, key: str | None, *, settings: Settings,
            preflight: dict[str, Any] | None) -> tuple[Job, bool]:
    project_id = access.project_for_create(session, owner, spec.project)
    try:
        job, created = service.create_job(session, spec, settings=settings, idempotency_key=key,
                                          owner_id=owner.user_id, preflight=preflight, project_id=project_id)
    except Conflict:  # its message names the key's job: not for another user's key
        session.rollback()
        _refuse_foreign_key(session, key, owner.user_id)
        raise
    if not created:
        _refuse_foreign_key(session, key, owner.user_id)
    return job, created


def _requeue(session: Session, spec: AnySpec, job_id: str, *, settings: Settings) -> Job:
    job = service.get_job(session, job_id)
    service.admit_any(session, spec, settings=settings, owner_id=job.owner_id, project_id=job.project_id, job_id=job_id)
    if not service.resume_stopped(session, job_id):
        raise service.resume_refused(service.get_job(session, job_id))
    return service.get_job(session, job_id)


def _continue_from(session: Session, job: Job, checkpoint: Checkpoint, *, settings: Settings) -> None:
    rerun.seed_checkpoint(session, job, checkpoint, settings=settings)
    service.append_events(session, job.job_id, [(
        "log", {"level": "info",
                "message": f"resumes job {checkpoint.job_id} from its checkpoint at step {checkpoint.step}"},
    )])
    session.refresh(job)


def _refuse_foreign_key(session: Session, key: str | None, user_id: str | None) -> None:
    """409 without naming anything of the job when ``key`` is another user's Idempotency-Key."""
    owner = session.scalar(select(Job.owner_id).where(Job.idempotency_key == key)) if key else None
    if owner is not None and owner != user_id:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used by another user; use a new key",
            param="Idempotency-Key",
        )
