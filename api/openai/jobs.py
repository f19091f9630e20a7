"""``/openai/v1/fine_tuning/jobs``: create, retrieve, list, cancel, pause, resume, list_events and
``checkpoints.list``, each over ftq's own job service.

Pause and resume: ftq's native API has no pause, so a pause is a cancel that keeps its
checkpoint. Pausing a running job asks its worker to stop it as a cancel does (the trainer
finishes its step, writes a checkpoint, exits); the job reads ``running`` until the trainer has
stopped, then ``paused`` (ftq's status is ``cancelled``). ``resume`` queues it again
(``core.jobs.service.resume_stopped``) and the trainer continues from that checkpoint, on the
same job id, with its step history intact. Pausing a queued job takes it out of the queue.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from sqlalchemy import Select, or_, select
from sqlalchemy.orm import Session

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.jobs.submit import enqueue, notify, submit
from api.openai import reports, translate
from api.openai.paging import newest_first
from api.openai.schemas import FineTuningJob, JobCreate, Page
from api.openai.twins import validation_twin
from api.state import AppState
from core.db import utcnow
from core.errors import Conflict, InvalidInput, NotFound
from core.files.models import File
from core.files.service import get_file
from core.jobs import eta, service
from core.jobs.models import Job
from core.jobs.spec import JobSpec
from core.jobs.states import JobStatus
from core.jobs.submit import SubmitRequest
from core.openai.models import OpenAIJob
from core.settings import Settings
from core.users import access
from core.users.service import Caller

router = APIRouter(prefix="/fine_tuning/jobs", tags=["openai fine-tuning"])
_METADATA_KEY = re.compile(r"metadata\[(.{1,64})\]")


@router.post("", summary="fine_tuning.jobs.create")
async def create_job(body: JobCreate, state: StateDep, caller: CallerDep) -> FineTuningJob:
    kind, requested = translate.method_of(body)
    translate.check_suffix(body.suffix)

    def translated() -> tuple[JobSpec, Any]:
        with state.sessions() as session:
            train = _named_file(session, caller, body.training_file, "training_file")
            validation = None
            if body.validation_file is not None:
                named = _named_file(session, caller, body.validation_file, "validation_file")
                validation = validation_twin(session, named, state.settings.files_dir).file_id
            return translate.native_spec(body, train, validation_file=validation, kind=kind, requested=requested)

    spec, resolved = await to_thread.run_sync(translated)

    def attach(session: Session, job: Job) -> None:
        session.add(OpenAIJob(
            job_id=job.job_id, suffix=body.suffix, user_metadata=body.metadata,
            method=translate.method_dict(kind, resolved), training_file=body.training_file,
            validation_file=body.validation_file, created_at=utcnow(),
        ))

    out, _ = await submit(state, SubmitRequest(spec, caller, attach=attach), _view)
    return out


@router.get("", summary="fine_tuning.jobs.list: newest first")
def list_jobs(request: Request, session: SessionDep, state: StateDep, caller: CallerDep, after: str | None = None,
              limit: Annotated[int, Query()] = 20) -> Page:
    """The caller's jobs (an admin's: everyone's). ``metadata[k]=v`` (several: all must match)
    lists only the jobs made here with that metadata; ``metadata=null``, those without any."""
    query = _metadata_filter(select(Job), request)
    rows, more = newest_first(session, query, Job, Job.job_id, after=after, limit=limit, what="job",
                              scope=access.readable_by(caller, Job))
    return Page.of(_views(session, rows, state.settings), more)


def _metadata_filter(query: Select[Any], request: Request) -> Select[Any]:
    pairs = [(k, v) for k, v in request.query_params.multi_items() if k.startswith("metadata")]
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


@router.get("/{job_id}", summary="fine_tuning.jobs.retrieve")
def retrieve_job(job_id: str, session: SessionDep, state: StateDep, caller: CallerDep) -> FineTuningJob:
    return _view(session, _get(session, caller, job_id), state.settings)


@router.post("/{job_id}/cancel", summary="fine_tuning.jobs.cancel")
async def cancel_job(job_id: str, state: StateDep, caller: CallerDep) -> FineTuningJob:
    return await _stop(state, caller, job_id, pause=False)


@router.post("/{job_id}/pause", summary="fine_tuning.jobs.pause: stop at a checkpoint (resume continues)")
async def pause_job(job_id: str, state: StateDep, caller: CallerDep) -> FineTuningJob:
    return await _stop(state, caller, job_id, pause=True)


@router.post("/{job_id}/resume", summary="fine_tuning.jobs.resume: queue a paused job again")
async def resume_job(job_id: str, state: StateDep, caller: CallerDep) -> FineTuningJob:
    def resume() -> tuple[FineTuningJob, int]:
        with state.sessions() as session:
            job = _get(session, caller, job_id)
            extra = session.get(OpenAIJob, job_id)
            if extra is None or extra.paused_at is None:
                raise Conflict(f"job {job_id} is not paused ({job.status}); only a paused job can be resumed",
                               param="job_id")
            if not service.resume_stopped(session, job_id):
                raise Conflict(
                    f"job {job_id} is still stopping ({job.status}); resume it once its status reads 'paused'"
                    if job.status == JobStatus.running.value else
                    f"job {job_id} {job.status} before the pause took effect; there is nothing to resume",
                    param="job_id",
                )
            extra.paused_at = None
            session.commit()
            job = service.get_job(session, job_id)
            return _view(session, job), job.last_event_seq

    out, seq = await to_thread.run_sync(resume)
    await to_thread.run_sync(enqueue, state, job_id)
    await notify(state, job_id, seq)
    return out


@router.get("/{job_id}/events", summary="fine_tuning.jobs.list_events: newest first")
def list_events(job_id: str, session: SessionDep, caller: CallerDep, after: str | None = None,
                limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> Page:
    _get(session, caller, job_id)
    events, more = reports.list_events(session, job_id, after=after, limit=limit)
    return Page.of(events, more)


@router.get("/{job_id}/checkpoints", summary="fine_tuning.jobs.checkpoints.list: newest first")
def list_checkpoints(job_id: str, session: SessionDep, caller: CallerDep, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = 10) -> Page:
    job = _get(session, caller, job_id)
    extra = session.get(OpenAIJob, job_id)
    owner = access.owner_name(session, job.owner_id)
    name = translate.fine_tuned_model(job, owner, extra.suffix if extra else job.name)
    checkpoints, more = reports.list_checkpoints(session, job, name, after=after, limit=limit)
    return Page.of(checkpoints, more)


async def _stop(state: AppState, caller: CallerDep, job_id: str, *, pause: bool) -> FineTuningJob:
    def stop() -> tuple[FineTuningJob, bool, int]:
        with state.sessions() as session:
            job = _get(session, caller, job_id)
            extra = session.get(OpenAIJob, job_id)
            if pause and extra is None:
                raise InvalidInput(
                    f"job {job_id} was submitted to ftq's native API, which has no pause; cancel it instead "
                    "(or pause jobs made through this API)",
                    param="job_id",
                )
            if extra is not None and extra.paused_at is not None:
                if pause:
                    raise Conflict(f"job {job_id} is already paused; resume or cancel it", param="job_id")
                extra.paused_at = None  # a cancel makes the pause final, stopped or still stopping
                if job.status == JobStatus.cancelled.value:
                    session.commit()
                    return _view(session, job), False, job.last_event_seq
            job, finished_now = service.cancel_job(session, job_id)
            if pause and extra is not None:
                extra.paused_at = utcnow()
            session.commit()
            return _view(session, job), finished_now, job.last_event_seq

    out, finished_now, seq = await to_thread.run_sync(stop)
    if finished_now:
        await notify(state, job_id, seq)
    return out


def _get(session: Session, caller: Caller, job_id: str) -> Job:
    """The caller's job (an admin: anyone's); another user's is as unknown (``core.users.access``)."""
    try:
        return service.get_job(session, job_id, reader=caller)
    except NotFound:
        raise NotFound(f"No such fine-tuning job: {job_id}", param="job_id") from None


def _named_file(session: Session, caller: Caller, file_id: str, param: str) -> File:
    """The caller's file named in the body; another user's is as unknown, so a job trains only
    on its submitter's files (an admin's on any), as ``core.users.access`` has it."""
    try:
        return get_file(session, file_id, reader=caller)
    except NotFound:
        raise InvalidInput(
            f"{param}: no file {file_id!r}; upload it with files.create(purpose='fine-tune') and use its id",
            param=param,
        ) from None


def _view(session: Session, job: Job, settings: Settings | None = None) -> FineTuningJob:
    return _views(session, [job], settings)[0]


def _views(session: Session, jobs: list[Job], settings: Settings | None = None) -> list[FineTuningJob]:
    """Jobs as OpenAI shows them, with three reads for the whole page (extras, tokens, owners)."""
    ids = [job.job_id for job in jobs]
    extras = {row.job_id: row for row in session.scalars(select(OpenAIJob).where(OpenAIJob.job_id.in_(ids)))}
    tokens = reports.trained_tokens(session, ids)
    finish = _finish_estimates(session, settings) if settings and any(j.status == "running" for j in jobs) else {}
    return [
        translate.fine_tuning_job(
            job, extras.get(job.job_id), owner=access.owner_name(session, job.owner_id),
            trained_tokens=tokens.get(job.job_id, 0), estimated_finish=finish.get(job.job_id),
            has_metrics=job.job_id in tokens,
        )
        for job in jobs
    ]


def _finish_estimates(session: Session, settings: Settings) -> dict[str, int]:
    """Unix seconds at which each running job should end, from its pace (``core.jobs.eta``)."""
    snapshot = eta.snapshot(session, settings)
    return {r.job_id: int(r.estimated_finish_at.timestamp()) for r in snapshot.running if r.estimated_finish_at}
