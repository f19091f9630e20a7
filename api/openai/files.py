"""``/openai/v1/files``: ``files.create/retrieve/list/delete/content`` over ftq's datasets.

An upload with ``purpose="fine-tune"`` is validated whole as every ftq upload is (a bad line is
a 400 whose message starts ``line N:``) and stored as an ftq ``train`` file, so it shows in
``/v1/files`` too. ShareGPT and Alpaca files are converted as ``POST /v1/files`` converts them,
and the same optional ``format`` field (``auto``, ``sharegpt``, ``alpaca``; an extra form field
the official client sends with ``extra_body``) is checked against the bytes, stored before or
not. A file that is no dataset but a valid prompts file (a reinforcement job's: chat records
without an answer, their other keys the grader's item) is stored as ``prompts`` (docs/grpo.md),
so an ``auto`` upload of OpenAI's reinforcement files works as it does there. A job's metrics CSV (``purpose: fine-tune-results``) is made from the store when asked for
(``api.openai.reports.metrics_csv``).
"""

from __future__ import annotations

from typing import Annotated

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, PlainTextResponse, Response
from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.files.upload import receive_upload
from api.openai import reports, translate
from api.openai.schemas import FileDeleted, FileObject, Page
from core.errors import InvalidInput, NotFound
from core.files import service
from core.files.models import File
from core.openai import twins
from core.jobs.models import Job
from core.jobs.service import get_job
from core.users import access
from core.users.service import Caller

router = APIRouter(prefix="/files", tags=["openai files"])
PURPOSE = "fine-tune"
EVALS = "evals"


@router.post("", summary="files.create: upload a fine-tuning JSONL (purpose fine-tune)")
async def create_file(request: Request, state: StateDep, caller: CallerDep) -> FileObject:
    settings = state.settings
    sink = await to_thread.run_sync(service.FileSink, settings.files_dir, settings.max_upload_bytes)
    with sink:
        form = await receive_upload(request, sink)
        purpose = form.fields.get("purpose")
        if purpose not in (PURPOSE, EVALS):
            raise InvalidInput(
                f"purpose: {purpose!r} is not supported here; ftq's OpenAI-compatible API takes "
                f"purpose='{PURPOSE}' (training and validation files alike) or '{EVALS}' (an eval run's items)",
                param="purpose",
            )

        def store() -> FileObject:
            with state.sessions() as session:
                row = service.store_upload(session, sink, filename=form.filename or "",
                                           purpose="evals" if purpose == EVALS else "train",
                                           files_dir=settings.files_dir, owner_id=caller.user_id,
                                           layout=form.fields.get("format") or "auto",
                                           project_id=access.project_for_create(session, caller, None),
                                           or_prompts=True)
                return translate.file_object(row)

        return await to_thread.run_sync(store)


@router.get("", summary="files.list: datasets, newest first")
def list_files(
    session: SessionDep,
    caller: CallerDep,
    purpose: str | None = None,
    limit: Annotated[int, Query()] = 100,
    after: str | None = None,
    order: str = "desc",
) -> Page:
    if purpose not in (None, PURPOSE):
        return Page.of([], False)
    if order != "desc":
        raise InvalidInput("order: ftq lists files newest first only; use order='desc' or leave it out",
                           param="order")
    rows, more = twins.list_files(session, caller, after=after, limit=limit)
    return Page.of([translate.file_object(row) for row in rows], more)


@router.get("/{file_id}", summary="files.retrieve")
def retrieve_file(file_id: str, session: SessionDep, caller: CallerDep) -> FileObject:
    job_id = translate.job_of_results_file(file_id)
    if job_id is not None:
        return _results_object(session, caller, file_id, job_id)
    return translate.file_object(_get(session, caller, file_id))


@router.delete("/{file_id}", summary="files.delete (the owner or an admin; not while a job uses it)")
def delete_file(file_id: str, session: SessionDep, caller: CallerDep) -> FileDeleted:
    _get(session, caller, file_id)
    service.delete_file(session, file_id, reader=caller)
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content", response_model=None, summary="files.content: the file's bytes")
def file_content(file_id: str, session: SessionDep, caller: CallerDep) -> Response:
    job_id = translate.job_of_results_file(file_id)
    if job_id is not None:
        _job_for_results(session, caller, file_id, job_id)
        return PlainTextResponse(reports.metrics_csv(session, job_id), media_type="text/csv")
    row = _get(session, caller, file_id)
    return FileResponse(row.path, media_type="application/octet-stream", filename=row.filename)


def _get(session: SessionDep, caller: Caller, file_id: str) -> File:
    """The caller's file (an admin: anyone's); another user's is as unknown (``core.users.access``)."""
    try:
        return service.get_file(session, file_id, reader=caller)
    except NotFound:
        raise NotFound(f"No such File object: {file_id}", param="file_id") from None


def _job_for_results(session: SessionDep, caller: Caller, file_id: str, job_id: str) -> Job:
    try:
        return get_job(session, job_id, reader=caller)
    except NotFound:
        raise NotFound(f"No such File object: {file_id}", param="file_id") from None


def _results_object(session: SessionDep, caller: Caller, file_id: str, job_id: str) -> FileObject:
    job = _job_for_results(session, caller, file_id, job_id)
    size = len(reports.metrics_csv(session, job_id).encode())
    when = job.finished_at or job.created_at
    return FileObject(id=file_id, bytes=size, created_at=int(when.timestamp()), filename="step_metrics.csv",
                      purpose="fine-tune-results")
