"""One submission path for every way a job is made: ``POST /v1/jobs``, clone (``ftq rerun``),
resume, and ``/openai/v1/fine_tuning/jobs``. Each entry only builds a ``SubmitRequest``; the
checks are the same for all of them, so a job refused at the door cannot come in by another one.

    entry (route)              a SubmitRequest: the spec, the caller, what comes with the job
    api.jobs.submit.submit     the dataset preflight (core.jobs.preflight, in the tokenizer pool),
                               then ``record`` in one transaction, commit, wake the worker
    record (here)              the caller may use the files; service.create_job's checks (method,
                               switches, trackers, GPUs and caps, files, objective, model, the
                               trainer's config); the Idempotency-Key; a resume's checkpoint linked
                               in; the entry's own rows (``attach``)

Nothing is written before every check passed: a refusal leaves the store as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import Conflict
from core.jobs import rerun, service
from core.jobs.models import Checkpoint, Job
from core.jobs.spec import JobSpec
from core.settings import Settings
from core.users import access
from core.users.service import Caller


@dataclass(frozen=True)
class SubmitRequest:
    """What an entry asks for; a new field here reaches every entry at once."""

    spec: JobSpec
    caller: Caller
    """The job's owner; it must be allowed to use the spec's files."""
    idempotency_key: str | None = None
    """A repeat with the same key and spec answers the job made first."""
    resume_from: Checkpoint | None = None
    """Resume: the checkpoint (of another job) the new job starts from."""
    attach: Callable[[Session, Job], None] | None = None
    """Rows the entry keeps beside a new job (the OpenAI API's), added in the same transaction."""

    @property
    def files(self) -> dict[str, str | None]:
        return {"training_file": self.spec.training_file, "validation_file": self.spec.validation_file}


def record(session: Session, request: SubmitRequest, *, settings: Settings,
           preflight: dict[str, Any] | None) -> tuple[Job, bool]:
    """Check ``request`` against the box and add its queued job; the caller commits, then enqueues.

    ``preflight``: the dataset report the caller computed (``api.jobs.preview.preflight_for``),
    stored on the job. Returns ``(job, created)``; ``created`` is False for an Idempotency-Key
    replay (nothing else is added then).

    Raises:
        Forbidden: the caller may not use a file the spec names.
        Conflict: the Idempotency-Key was used with another spec, or by another user.
        InvalidInput, Unsupported: whatever ``service.create_job`` refuses.
    """
    access.require_usable_files(session, request.caller, request.files)
    key, owner_id = request.idempotency_key, request.caller.user_id
    try:
        job, created = service.create_job(session, request.spec, settings=settings, idempotency_key=key,
                                          owner_id=owner_id, preflight=preflight,
                                          project_id=access.project_for_create(session, request.caller,
                                                                               request.spec.project))
    except Conflict:  # its message names the key's job: not for another user's key
        session.rollback()
        _refuse_foreign_key(session, key, owner_id)
        raise
    if not created:
        _refuse_foreign_key(session, key, owner_id)
        return job, False
    if request.resume_from is not None:
        _continue_from(session, job, request.resume_from, settings=settings)
    if request.attach is not None:
        request.attach(session, job)
    return job, True


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
