"""``/v1/jobs``: submit, list, read, cancel, clone, resume; metrics (JSON, CSV), events (SSE),
checkpoints, adapter.

Submit, clone and resume make a job through one path (``core.jobs.submit``, with this process's
``api.jobs.submit.ApiPorts``): the same checks and dataset preflight for each. It commits the job, then
signals the worker host the queue policy places it on (``core.queue.enqueue_job``; any host when
it must wait). If the broker is down at that moment the job is still created (201) and stays
``queued``: the store is the source of truth, the message only a wake-up, and the worker's reaper
re-sends it for queued jobs nobody claimed (as does a retry of the same request with its
``Idempotency-Key``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Body, Header, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.inputs import INT32_MAX, INT64_MAX
from api.jobs import artifacts, exports
from api.jobs.card import build_card
from api.jobs.preview import preflight_for
from api.jobs.schemas import (
    CheckpointList,
    CheckpointOut,
    EvalOut,
    JobList,
    JobOut,
    MetricList,
    MetricOut,
    PreflightOut,
    ResumeRequest,
    metrics_csv,
    queue_info,
)
from api.jobs.sse import event_stream
from api.jobs.submit import ApiPorts, notify
from api.responses import TemporaryFileResponse, temporaries_dir
from api.state import AppState
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import artifact_store, eta, rerun, service
from core.jobs.models import Job
from core.jobs.eval_spec import EvalJobSpec
from core.jobs.generate_spec import GenerateSpec, is_generate
from core.jobs.spec import JobSpec
from core.jobs.states import JobStatus
from core.jobs.submit import Origin, submit
from core.paging import MAX_LIMIT
from core.projects.service import names_by_id as project_names
from core.settings import Settings
from core.users import access
from core.users.service import names_by_id
from core.workers import pool
from trainer.training import layout

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_JOB_RESPONSES = {200: {"model": JobOut, "description": "Replay of an Idempotency-Key: the job made earlier"}}


_SUBMIT_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": "#/components/schemas/JobSpec"}, {"$ref": "#/components/schemas/GenerateSpec"}]}}}}}


def parse_spec(body: Any, request: Request) -> JobSpec | GenerateSpec:
    """A ``POST /v1/jobs`` body as a training spec, or with ``kind: generate`` a generation spec;
    a refusal is the 422 FastAPI gives a typed body (``loc`` from ``body``, naming the field; the
    model on ``request.state.body_model`` for the known-fields hint)."""
    model: type[JobSpec | GenerateSpec] = GenerateSpec if is_generate(body) else JobSpec
    request.state.body_model = model
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


@router.post("", status_code=status.HTTP_201_CREATED, responses=_JOB_RESPONSES, summary="Submit a job",
             openapi_extra=_SUBMIT_BODY)
async def create_job(
    body: Annotated[Any, Body(include_in_schema=False)],
    request: Request,
    response: Response,
    state: StateDep,
    caller: CallerDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobOut:
    """Validate and queue a job owned by the caller: a fine-tuning job (``JobSpec``), or with
    ``kind: generate`` a batch generation job (``GenerateSpec``: docs/generation.md).

    201 with the new job. With an ``Idempotency-Key`` header, a repeat of the same body
    answers 200 with the same job (header ``Idempotent-Replayed: true``); the same key with a
    different body, or a key another user already used, is a 409. The job may use only the
    caller's own files (an admin's, any): 403 otherwise.
    """
    spec = parse_spec(body, request)
    job, created = await submit(ApiPorts(state), spec, caller, Origin(idempotency_key=idempotency_key),
                                view=lambda session, row: _out(session, row, state.settings, estimate=False))
    if not created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    return job


@router.post("/preview", summary="Preflight a job without creating it")
async def preview_job(spec: JobSpec, state: StateDep, caller: CallerDep) -> PreflightOut:
    """The dataset under the model's own tokenizer and chat template, as ``POST /v1/jobs`` checks it:
    records, trainable tokens and their fraction, what ``max_seq_len`` truncation cuts, one rendered
    record with its trainable runs marked, and the warnings a job would store. 422 (naming the
    field) where the job would be refused: a dataset with no trainable token, a model whose files
    do not match its config.json."""
    return PreflightOut.model_validate(await preflight_for(state, spec, caller))


@router.get("", summary="List jobs, newest first")
def list_jobs(
    session: SessionDep,
    caller: CallerDep,
    status_: Annotated[
        str | None, Query(alias="status", description="One status or several, comma-separated")
    ] = None,
    owner: Annotated[str | None, Query(description="Only this user's jobs; `me` for the caller's")] = None,
    project: Annotated[str | None, Query(description="Only this project's jobs (one of yours)")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 20,
    after: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    q: Annotated[str | None, Query(max_length=200, description="Only jobs whose name, model or owner's "
                                   "name contains this text (case-insensitive)")] = None,
) -> JobList:
    """The jobs of the caller's projects (a global admin: every project's), each with its ``owner``
    and ``project``."""
    owner_id = access.owner_filter(session, caller, owner)
    jobs, next_cursor = service.list_jobs(
        session, statuses=_parse_statuses(status_), owner_id=owner_id, limit=limit, after=after, text=q,
        reader=caller, project_id=access.project_filter(session, caller, project),
    )
    names = names_by_id(session, {j.owner_id for j in jobs})
    projects = project_names(session, {j.project_id for j in jobs})
    held = pool.held_by(session, [j.job_id for j in jobs if j.status == JobStatus.running.value])
    return JobList(
        data=[JobOut.of(j, owner=names.get(j.owner_id or ""), held=held.get(j.job_id, ()),
                        project=projects.get(j.project_id or "")) for j in jobs],
        next_cursor=next_cursor,
    )


@router.get("/{job_id}", summary="Read one job")
def get_job(job_id: str, session: SessionDep, state: StateDep, caller: CallerDep) -> JobOut:
    """A queued job also has ``queue``: its position and estimated start (see ``GET /v1/queue``)."""
    return _out(session, service.get_job(session, job_id, reader=caller), state.settings)


@router.post(
    "/{job_id}/cancel",
    responses={202: {"model": JobOut, "description": "Running: the worker stops it (checkpoint, then exit)"}},
    summary="Cancel a job",
)
async def cancel_job(job_id: str, response: Response, state: StateDep, caller: CallerDep) -> JobOut:
    """A queued job is cancelled at once (200). A running one is asked to stop (202,
    ``cancel_requested: true``); its state turns ``cancelled`` when the trainer has exited.
    A finished job answers 409; someone else's job 403 (unless the caller is an admin of its
    project or of the box)."""

    def cancel() -> tuple[JobOut, bool, int]:
        with state.sessions() as session:
            row = service.get_job(session, job_id, reader=caller)
            access.require_owner(
                session, caller, row.owner_id, what=f"job {job_id}", action="cancel", param="job_id",
                project_id=row.project_id,
            )
            job, finished_now = service.cancel_job(session, job_id)
            session.commit()
            return _out(session, job), finished_now, job.last_event_seq

    job, finished_now, seq = await to_thread.run_sync(cancel)
    if finished_now:
        await notify(state, job_id, seq)
    else:
        response.status_code = status.HTTP_202_ACCEPTED
    return job


@router.post("/{job_id}/clone", status_code=status.HTTP_201_CREATED, summary="Submit a copy of a job, with overrides")
async def clone_job(
    job_id: str,
    state: StateDep,
    caller: CallerDep,
    overrides: Annotated[dict[str, Any] | None, Body(
        description="Fields to change, as a JSON merge patch of the job's spec: "
        '{"hyperparameters": {"learning_rate": 1e-4}, "name": "lr 1e-4"}; null restores a field\'s default')] = None,
) -> JobOut:
    """A new queued job from the source's stored spec (defaults as they were then) merged with
    ``overrides``, submitted like ``POST /v1/jobs``: the same checks and dataset preflight, the
    same 422 naming the field (e.g. ``hyperparameters.learning_rate``, or ``training_file`` when
    the model's tokenizer can no longer train on the source's data). The caller owns the new job."""

    def cloned() -> JobSpec | GenerateSpec:
        with state.sessions() as session:
            source = service.get_job(session, job_id, reader=caller)
        try:
            return rerun.in_project_of(rerun.cloned_spec(source.spec, overrides or {}), source)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None

    spec = await to_thread.run_sync(cloned)
    job, _ = await submit(ApiPorts(state), spec, caller, view=lambda session, row: _out(session, row, state.settings))
    return job


@router.post("/{job_id}/resume", status_code=status.HTTP_201_CREATED, summary="Resume a stopped job from a checkpoint")
async def resume_job(job_id: str, state: StateDep, caller: CallerDep, body: ResumeRequest | None = None) -> JobOut:
    """A new queued job continuing a ``failed`` or ``cancelled`` one from its checkpoint at
    ``step`` (default: its newest), with the same spec, submitted like ``POST /v1/jobs`` (the same
    checks and dataset preflight); the source is left as it is. A cancelled generation job is
    queued again itself (its id, its output directory): it continues at the first prompt with
    no completion, and nothing is generated twice. 409 for a job in another state or
    without checkpoints; 404 for a step without a checkpoint."""

    def resumed() -> tuple[JobSpec | GenerateSpec, Origin]:
        with state.sessions() as session:
            source = service.get_job(session, job_id, reader=caller)
            if source.kind in ("generate", "eval"):  # the same job again: it continues at the first undone prompt
                spec = (EvalJobSpec if source.kind == "eval" else GenerateSpec).model_validate(source.spec)
                return rerun.in_project_of(spec, source), Origin(requeue=job_id)
            checkpoint = rerun.pick_checkpoint(session, source, body.step if body else None, settings=state.settings)
            return rerun.in_project_of(rerun.resumed_spec(source), source), Origin(resume_from=checkpoint)

    spec, origin = await to_thread.run_sync(resumed)
    job, _ = await submit(ApiPorts(state), spec, caller, origin,
                          view=lambda session, row: _out(session, row, state.settings))
    return job


@router.get(
    "/{job_id}/metrics.csv",
    response_class=Response,
    responses={200: {"content": {"text/csv": {}}, "description": "One row per step, a column per metric"}},
    summary="Step metrics as a CSV file",
)
def download_metrics_csv(job_id: str, session: SessionDep, caller: CallerDep) -> Response:
    """Every step row (the fields of ``GET /v1/jobs/{id}/metrics`` but the per-rank list),
    ready for a spreadsheet or pandas."""
    rows, after = [], -1
    while page := service.list_metrics(session, job_id, after_step=after, limit=service.MAX_METRICS_PAGE,
                                       reader=caller):
        rows.extend(page)
        after = page[-1].step
    return Response(metrics_csv(rows), media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'})


@router.get("/{job_id}/metrics", summary="Step metrics in step order")
def list_metrics(
    job_id: str,
    session: SessionDep,
    caller: CallerDep,
    after_step: Annotated[int, Query(ge=-1, le=INT32_MAX)] = -1,
    limit: Annotated[int, Query(ge=1, le=service.MAX_METRICS_PAGE)] = 1000,
) -> MetricList:
    rows = service.list_metrics(session, job_id, after_step=after_step, limit=limit, reader=caller)
    next_after = rows[-1].step if len(rows) == limit else None
    evals = [EvalOut.model_validate(e, from_attributes=True) for e in service.list_evals(session, job_id)]
    return MetricList(data=[MetricOut.of(r) for r in rows], next_after_step=next_after, eval=evals)


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "id: seq, event: type, data: json"}},
    summary="Job events as Server-Sent Events (resumable with Last-Event-ID)",
)
def stream_events(
    job_id: str,
    session: SessionDep,
    state: StateDep,
    caller: CallerDep,
    after: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="Start after this seq (Last-Event-ID wins)")] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    start = after or 0
    if last_event_id is not None and last_event_id.strip():
        if not (last_event_id.strip().isascii() and last_event_id.strip().isdigit()) or len(last_event_id.strip()) > 18:
            raise InvalidInput(
                f"Last-Event-ID: {last_event_id!r} is not an event id; send the id: of the last event received",
                param="Last-Event-ID",
            )
        start = int(last_event_id)
    service.get_job(session, job_id, reader=caller)
    session.close()
    return StreamingResponse(
        event_stream(state, job_id, start),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/{job_id}/checkpoints", summary="The job's checkpoints")
def list_checkpoints(job_id: str, session: SessionDep, caller: CallerDep) -> CheckpointList:
    return CheckpointList(data=[CheckpointOut.of(c) for c in service.list_checkpoints(session, job_id, reader=caller)])


@router.get(
    "/{job_id}/checkpoints/{step}/download",
    response_class=FileResponse,
    responses={200: {"content": {"application/zip": {}, "application/gzip": {}}}},
    summary="Download a checkpoint directory as an archive",
)
def download_checkpoint(
    job_id: str,
    step: Annotated[int, PathParam(ge=0, le=INT32_MAX)],
    session: SessionDep,
    state: StateDep,
    caller: CallerDep,
    format: artifacts.ArchiveFormat = "zip",
) -> FileResponse:
    checkpoint = service.get_checkpoint(session, job_id, step, reader=caller)
    job = service.get_job(session, job_id)
    root = _job_root(state, job)
    session.close()
    src = artifact_store.checkpoint_store_dir(state.settings, job_id, checkpoint.step)
    if not src.is_dir() and (shared := artifact_store.shared_checkpoint_dir(state.settings, job_id, step)):
        src, root = shared, shared.parent.parent  # the API host mounts the machines' shared directory
    elif not src.is_dir() and artifact_store.written_to_shared(checkpoint.path, job_id, step, job.output_dir):
        raise Conflict(
            f"checkpoint {step} of job {job_id} was written to the shared checkpoint directory of the machines "
            f"that ran it ({checkpoint.path}) and is not uploaded; read it there, mount that directory on the "
            "API host at the same path with FTQ_SHARED_DIR, or download the final model once the job has succeeded",
            param="step",
        )
    return _archive_response(state, src, format, f"{job_id}-step-{step}", root)


@router.get(
    "/{job_id}/adapter",
    response_class=FileResponse,
    responses={200: {"content": {"application/zip": {}, "application/gzip": {}}}},
    summary="Download the final adapter (adapter files, README.md model card, the base's tokenizer)",
)
def download_adapter(
    job_id: str, session: SessionDep, state: StateDep, caller: CallerDep, format: artifacts.ArchiveFormat = "zip"
) -> FileResponse:
    """The files are at the archive's root; 409 until the job has succeeded. For method
    ``full`` this is the whole fine-tuned model (``save_pretrained`` output). Self-describing
    (``api.jobs.card``): ``base_model_name_or_path`` is the base's hub id or its name under the
    model root, ``README.md`` is the model card, the tokenizer and chat template come along."""
    job = service.get_job(session, job_id, reader=caller)
    if job.status != JobStatus.succeeded.value:
        raise Conflict(
            f"job {job_id} is {job.status}; the adapter can be downloaded once it has succeeded. Its checkpoints "
            f"(GET /v1/jobs/{job_id}/checkpoints; `ftq download {job_id} --step N`) can be downloaded now",
            param="job_id",
        )
    export = layout.export_name(job.method)
    adapter = artifact_store.final_store_dir(state.settings, job_id, job.method)
    if not adapter.is_dir():
        final = [c for c in service.list_checkpoints(session, job_id) if c.final]
        if not final:
            raise NotFound(f"job {job_id} succeeded but its adapter is not on disk", param="job_id")
        adapter = artifact_store.checkpoint_store_dir(state.settings, job_id, final[-1].step)
    root = _job_root(state, job)
    card = build_card(session, job, state.settings)
    session.close()
    return _archive_response(state, adapter, format, f"{job_id}-{export}", root,
                             members=artifacts.adapter_members(adapter, card))


def _job_root(state: AppState, job: Job) -> Path:
    """The job's directory in the API's artifact store (not the worker's ``output_dir``)."""
    return artifact_store.job_store_dir(state.settings, job.job_id)


def _archive_response(
    state: AppState, src: Path, fmt: artifacts.ArchiveFormat, stem: str, root: Path,
    members: list[artifacts.Member] | None = None,
) -> FileResponse:
    # Checkpoint paths come from the trainer's stdout: serve only what lies in the job's own
    # directory, whatever a stray or hostile event line said.
    if not src.resolve().is_relative_to(root.resolve()):
        raise NotFound(f"{stem}: the files are not in the job's directory", param="job_id")
    path = artifacts.build_archive(src, fmt, temporaries_dir(state.settings), members)
    return TemporaryFileResponse(path, media_type=artifacts.MEDIA_TYPES[fmt], filename=f"{stem}.{fmt}")


def _out(session: Session, job: Job, settings: Settings | None = None, *, estimate: bool = True) -> JobOut:
    """The job as the API shows it; with ``settings``, a queued job also gets its ``queue``:
    its position and, with ``estimate``, its start estimate (a replay of the whole queue, which
    a submission's answer skips: ``estimated_start_at`` is null there; GET the job for it)."""
    held = pool.held_by(session, [job.job_id]).get(job.job_id, ()) if job.status == JobStatus.running.value else ()
    out = JobOut.of(job, owner=access.owner_name(session, job.owner_id), held=held,
                    project=project_names(session, {job.project_id}).get(job.project_id or ""))
    if settings is not None and job.status == JobStatus.queued.value:
        entry = eta.snapshot(session, settings).entry(job.job_id) if estimate else eta.position(session, job.job_id)
        out.queue = queue_info(entry)
    return out


def _parse_statuses(raw: str | None) -> list[JobStatus] | None:
    if not raw:
        return None
    try:
        return [JobStatus(part.strip()) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise InvalidInput(
            f"status: {raw!r} is not a job status; use {', '.join(s.value for s in JobStatus)} "
            "(comma-separated for several)",
            param="status",
        ) from None


router.include_router(exports.router)  # /v1/jobs/{id}/exports (api/jobs/exports.py)
