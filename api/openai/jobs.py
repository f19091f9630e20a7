"""``/openai/v1/fine_tuning/jobs``: create, retrieve, list, cancel, pause, resume, list_events and
``checkpoints.list``, each over ftq's own job services.

Create and resume queue a job through the one submission path (``core.jobs.submit``): the same
checks and dataset preflight as ``POST /v1/jobs``. Pause is a cancel that keeps its checkpoint;
resume queues the paused job again under its own id (``core.openai.jobs`` says how).
"""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from sqlalchemy.orm import Session

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.jobs.submit import ApiPorts, notify
from api.openai import reports, translate
from api.openai.schemas import FineTuningJob, JobCreate, Page
from api.state import AppState
from core.errors import InvalidInput, NotFound
from core.evals import after_training
from core.files.models import File
from core.files.service import get_file
from core.jobs import eta, rerun, service
from core.jobs.models import Job
from core.jobs.spec import JobSpec
from core.jobs.submit import Origin, submit
from core.openai import catalog, history
from core.openai import jobs as openai_jobs
from core.openai.twins import validation_twin
from core.settings import Settings
from core.users import access
from core.users.service import Caller

router = APIRouter(prefix="/fine_tuning/jobs", tags=["openai fine-tuning"])


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
        openai_jobs.keep(session, job, suffix=body.suffix, metadata=body.metadata,
                         method=translate.method_dict(kind, resolved, translate.grader_of(body)),
                         training_file=body.training_file,
                         validation_file=body.validation_file)

    out, _ = await submit(ApiPorts(state), spec, caller, Origin(attach=attach),
                          view=lambda session, job: _view(session, job, state.settings))
    return out


@router.get("", summary="fine_tuning.jobs.list: newest first")
def list_jobs(request: Request, session: SessionDep, state: StateDep, caller: CallerDep, after: str | None = None,
              limit: Annotated[int, Query()] = 20) -> Page:
    """The caller's jobs (an admin's: everyone's). ``metadata[k]=v`` (several: all must match)
    lists only the jobs made here with that metadata; ``metadata=null``, those without any."""
    pairs = [(k, v) for k, v in request.query_params.multi_items() if k.startswith("metadata")]
    rows, more = openai_jobs.list_jobs(session, caller, pairs, after=after, limit=limit)
    return Page.of(_views(session, rows, state.settings), more)


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
    def paused() -> JobSpec:
        with state.sessions() as session:
            job = _get(session, caller, job_id)
            openai_jobs.check_paused(session, job)
            return rerun.in_project_of(rerun.resumed_spec(job), job)

    spec = await to_thread.run_sync(paused)
    origin = Origin(requeue=job_id, attach=openai_jobs.unpause)
    out, _ = await submit(ApiPorts(state), spec, caller, origin,
                          view=lambda session, job: _view(session, job, state.settings))
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
    extra = openai_jobs.extra(session, job_id)
    owner = access.owner_name(session, job.owner_id)
    name = catalog.fine_tuned_model(job, owner, extra.suffix if extra else job.name)
    checkpoints, more = reports.list_checkpoints(session, job, name, after=after, limit=limit)
    return Page.of(checkpoints, more)


async def _stop(state: AppState, caller: CallerDep, job_id: str, *, pause: bool) -> FineTuningJob:
    def stop() -> tuple[FineTuningJob, bool, int]:
        with state.sessions() as session:
            job, finished_now = openai_jobs.stop(session, _get(session, caller, job_id), pause=pause)
            session.commit()
            return _view(session, job, state.settings), finished_now, job.last_event_seq

    out, finished_now, seq = await to_thread.run_sync(stop)
    if finished_now:
        await notify(state, job_id, seq)
    return out


def _get(session: Session, caller: Caller, job_id: str) -> Job:
    """The caller's job (an admin: anyone's); another user's is as unknown (``core.users.access``),
    and so is a generation job (``kind: generate``: not a fine-tuning job; the native API has it)."""
    try:
        job = service.get_job(session, job_id, reader=caller)
    except NotFound:
        job = None
    if job is None or job.kind != "train":
        raise NotFound(f"No such fine-tuning job: {job_id}", param="job_id")
    return job


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


def _view(session: Session, job: Job, settings: Settings) -> FineTuningJob:
    return _views(session, [job], settings)[0]


def _views(session: Session, jobs: list[Job], settings: Settings) -> list[FineTuningJob]:
    """Jobs as OpenAI shows them, with three reads for the whole page (extras, tokens, owners)."""
    ids = [job.job_id for job in jobs]
    extras = openai_jobs.extras(session, ids)
    tokens = history.trained_tokens(session, ids)
    finish = _finish_estimates(session, settings) if any(j.status == "running" for j in jobs) else {}
    return [
        translate.fine_tuning_job(
            job, extras.get(job.job_id), owner=access.owner_name(session, job.owner_id),
            trained_tokens=tokens.get(job.job_id, 0), estimated_finish=finish.get(job.job_id),
            has_metrics=job.job_id in tokens, evals=after_training.summary(session, job, settings),
        )
        for job in jobs
    ]


def _finish_estimates(session: Session, settings: Settings) -> dict[str, int]:
    """Unix seconds at which each running job should end, from its pace (``core.jobs.eta``)."""
    snapshot = eta.snapshot(session, settings)
    return {r.job_id: int(r.estimated_finish_at.timestamp()) for r in snapshot.running if r.estimated_finish_at}
