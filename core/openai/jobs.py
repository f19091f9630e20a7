"""The OpenAI-compatible API's jobs over ftq's own: the row each keeps beside its job
(``core.openai.models.OpenAIJob``), listing by ``metadata``, and pause, cancel and resume.

Pause: ftq's native API has no pause, so a pause is a cancel that keeps its checkpoint. Pausing a
running job asks its worker to stop it as a cancel does (the trainer finishes its step, writes a
checkpoint, exits); the job reads ``running`` until the trainer has stopped, then ``paused``
(ftq's status is ``cancelled``). Resume queues it again through the one submission path
(``core.jobs.submit``, ``Origin(requeue=...)``: the same checks as a new job), and the trainer
continues from that checkpoint, on the same job id, with its step history intact. Pausing a
queued job takes it out of the queue. Each function takes a session; the caller commits.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Select, or_, select
from sqlalchemy.orm import Session

from core.db import utcnow
from core.errors import Conflict, InvalidInput
from core.jobs import service
from core.jobs.models import Job
from core.jobs.states import JobStatus
from core.openai.models import OpenAIJob
from core.openai.paging import newest_first
from core.users.access import readable_by
from core.users.service import Caller

_METADATA_KEY = re.compile(r"metadata\[(.{1,64})\]")


def keep(session: Session, job: Job, *, suffix: str | None, metadata: dict[str, Any] | None,
         method: dict[str, Any], training_file: str, validation_file: str | None) -> OpenAIJob:
    """Add the OpenAI fields of a job just made through ``/openai/v1`` (the file ids as named)."""
    row = OpenAIJob(job_id=job.job_id, suffix=suffix, user_metadata=metadata, method=method,
                    training_file=training_file, validation_file=validation_file, created_at=utcnow())
    session.add(row)
    return row


def extra(session: Session, job_id: str) -> OpenAIJob | None:
    """The OpenAI fields of ``job_id``; None for a job made through the native API."""
    return session.get(OpenAIJob, job_id)


def extras(session: Session, job_ids: list[str]) -> dict[str, OpenAIJob]:
    """``{job_id: OpenAI fields}`` of those of ``job_ids`` made through ``/openai/v1`` (one query)."""
    return {row.job_id: row for row in session.scalars(select(OpenAIJob).where(OpenAIJob.job_id.in_(job_ids)))}


def list_jobs(session: Session, caller: Caller, metadata: list[tuple[str, str]], *, after: str | None,
              limit: int) -> tuple[list[Job], bool]:
    """The caller's fine-tuning jobs newest first (``core.openai.paging``), and whether more follow.
    ``metadata``: the query's ``metadata[k]=v`` pairs (all must match), or ``[("metadata", "null")]``
    for the jobs made here without any.

    Raises:
        InvalidInput: a ``metadata`` parameter of neither form, or a bad ``after``/``limit``.
    """
    query = _metadata_filter(select(Job).where(Job.kind == "train"), metadata)  # generation jobs are not fine-tuning
    return newest_first(session, query, Job, Job.job_id, after=after, limit=limit, what="job",
                        scope=readable_by(caller, Job))


def _metadata_filter(query: Select[Any], pairs: list[tuple[str, str]]) -> Select[Any]:
    if not pairs:
        return query
    if pairs == [("metadata", "null")]:
        return query.outerjoin(OpenAIJob, OpenAIJob.job_id == Job.job_id).where(
            or_(OpenAIJob.job_id.is_(None), OpenAIJob.user_metadata.is_(None)))
    query = query.join(OpenAIJob, OpenAIJob.job_id == Job.job_id)
    for name, value in pairs:
        match = _METADATA_KEY.fullmatch(name)
        if match is None:
            raise InvalidInput(
                f"{name}: filter by metadata as metadata[KEY]=VALUE (or metadata=null), not both forms",
                param="metadata",
            )
        query = query.where(OpenAIJob.user_metadata[match.group(1)].as_string() == value)
    return query


def stop(session: Session, job: Job, *, pause: bool) -> tuple[Job, bool]:
    """Cancel ``job``, or (``pause``) stop it keeping its checkpoint. Returns ``(job, finished_now)``
    as ``core.jobs.service.cancel_job`` does. A cancel of a paused job makes the pause final.

    Raises:
        InvalidInput: a pause of a job made through the native API (which has no pause).
        Conflict: the job is already paused (pause), or already finished.
    """
    row = extra(session, job.job_id)
    if pause and row is None:
        raise InvalidInput(
            f"job {job.job_id} was submitted to ftq's native API, which has no pause; cancel it instead "
            "(or pause jobs made through this API)",
            param="job_id",
        )
    if row is not None and row.paused_at is not None:
        if pause:
            raise Conflict(f"job {job.job_id} is already paused; resume or cancel it", param="job_id")
        row.paused_at = None  # a cancel makes the pause final, stopped or still stopping
        if job.status == JobStatus.cancelled.value:
            return job, False
    job, finished_now = service.cancel_job(session, job.job_id)
    if pause and row is not None:
        row.paused_at = utcnow()
    return job, finished_now


def check_paused(session: Session, job: Job) -> None:
    """Refuse to resume ``job`` unless a pause stopped it (its trainer has exited).

    Raises:
        Conflict: the job is not paused, still stopping, or finished before the pause took effect.
    """
    row = extra(session, job.job_id)
    if row is None or row.paused_at is None:
        raise Conflict(f"job {job.job_id} is not paused ({job.status}); only a paused job can be resumed",
                       param="job_id")
    if job.status != JobStatus.cancelled.value:
        raise service.resume_refused(job)


def unpause(session: Session, job: Job) -> None:
    """Clear the pause of ``job``, queued again (``core.jobs.submit``'s ``attach`` of a resume)."""
    row = extra(session, job.job_id)
    if row is not None:
        row.paused_at = None
