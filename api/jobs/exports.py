"""``/v1/jobs/{id}/exports``: ask for a merged or GGUF export of a finished job, follow it, download it.

The export runs on the worker host that ran the job (it holds the files and the base weights);
the API only records the request and signals that host (``core.queue.enqueue_export``). If the
broker is down the export is still created and stays ``queued``; asking again re-sends it.
Progress is on the export (``stage``, ``progress``) and in the job's events (type ``export``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Annotated, Literal

from anyio import to_thread
from fastapi import APIRouter, Response, status
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.inputs import shown
from api.jobs import artifacts
from api.responses import TemporaryFileResponse, temporaries_dir
from api.state import AppState
from core.errors import Conflict, NotFound
from core.exports import service
from core.exports.models import Export
from core.jobs import artifact_store
from core.jobs.models import Job
from core.jobs.service import get_job
from core.queue import enqueue_export
from core.users import access
from trainer.catalog import DEFAULT_QUANTIZATION, EXPORT_FORMATS, GGUF_MODEL_TYPES, QUANTIZATIONS

log = logging.getLogger(__name__)
router = APIRouter(tags=["exports"])
"""Included by ``api.jobs.routes.router`` (prefix ``/v1/jobs``)."""
EXPORT_ID = re.compile(r"exp-[0-9a-f]{24}")
"""``core.db.new_id("exp")``; any other id (``..``, ``exp-%00``) is unknown without asking the store."""


class ExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Annotated[Literal[EXPORT_FORMATS], Field(  # type: ignore[valid-type]
        description="merged: base + adapter in the base's dtype, safetensors, tokenizer and chat template; "
        f"gguf: one llama.cpp file, chat template in its metadata ({', '.join(GGUF_MODEL_TYPES)}).")]
    quantization: Annotated[Literal[QUANTIZATIONS] | None, Field(  # type: ignore[valid-type]
        description=f"gguf only: tensor type (default {DEFAULT_QUANTIZATION}).")] = None


class ExportOut(BaseModel):
    id: str
    job_id: str
    format: str
    quantization: str | None
    status: str
    """queued, running, succeeded or failed."""
    stage: str | None
    progress: float
    bytes: int | None
    error_code: str | None
    error_message: str | None
    created_at: str | None
    finished_at: str | None
    download_url: str | None

    @classmethod
    def of(cls, export: Export) -> ExportOut:
        url = f"/v1/jobs/{export.job_id}/exports/{export.export_id}/download" if export.status == "succeeded" else None
        return cls(**service.view(export), download_url=url)


class ExportList(BaseModel):
    data: list[ExportOut]


@router.post("/{job_id}/exports", status_code=status.HTTP_202_ACCEPTED, summary="Export a finished job")
async def create_export(job_id: str, body: ExportRequest, response: Response, state: StateDep,
                        caller: CallerDep) -> ExportOut:
    """202 with the new export, queued on the host that ran the job. An export of the same format
    and quantization still queued or running is answered instead (200). 409 unless the job has
    succeeded; only the job's owner, an admin of its project or an admin may export it (403)."""

    def create() -> tuple[ExportOut, bool, str | None, int]:
        with state.sessions() as session:
            job = get_job(session, job_id, reader=caller)
            access.require_owner(session, caller, job.owner_id, what=f"job {job_id}", action="export", param="job_id",
                                 project_id=job.project_id)
            export, created = service.create_export(session, job_id, body.format, body.quantization,
                                                    owner_id=caller.user_id, model_type=_model_type(state, job))
            seq = service.last_seq(session, job_id)
            session.commit()
            return ExportOut.of(export), created, export.worker_id, seq

    out, created, host, seq = await to_thread.run_sync(create)
    if out.status == "queued":
        await to_thread.run_sync(_enqueue, state, out.id, host)
    if not created:
        response.status_code = status.HTTP_200_OK
    elif state.redis is not None:
        from core.jobs import live

        try:
            await state.redis.publish(live.channel(job_id), live.message(seq))
        except Exception as exc:  # noqa: BLE001 - viewers fall back to re-reading the store
            log.warning("could not publish job %s event %s: %s", job_id, seq, exc)
    return out


@router.get("/{job_id}/exports", summary="A job's exports, oldest first")
def list_exports(job_id: str, session: SessionDep, caller: CallerDep) -> ExportList:
    return ExportList(data=[ExportOut.of(e) for e in service.list_exports(session, job_id, reader=caller)])


@router.get("/{job_id}/exports/{export_id}", summary="One export")
def get_export(job_id: str, export_id: str, session: SessionDep, caller: CallerDep) -> ExportOut:
    get_job(session, job_id, reader=caller)
    return ExportOut.of(_export(session, job_id, export_id))


@router.get(
    "/{job_id}/exports/{export_id}/download",
    response_class=FileResponse,
    responses={200: {"content": {"application/zip": {}, "application/octet-stream": {}}}},
    summary="Download an export: merged as a zip (or tar.gz), gguf as the .gguf file",
)
def download_export(job_id: str, export_id: str, session: SessionDep, state: StateDep, caller: CallerDep,
                    format: artifacts.ArchiveFormat = "zip") -> FileResponse:
    get_job(session, job_id, reader=caller)
    export = _export(session, job_id, export_id)
    if export.status != "succeeded" or not export.path:
        raise Conflict(f"export {export_id} is {export.status}; download it once it has succeeded", param="export_id")
    get_job(session, job_id)
    session.close()
    src = artifact_store.export_store_dir(state.settings, job_id, export_id)  # not the worker's export.path
    root = artifact_store.job_store_dir(state.settings, job_id)
    if not src.resolve().is_relative_to(root.resolve()) or not src.is_dir():
        raise NotFound(f"export {export_id}: the files are no longer on disk", param="export_id")
    stem = f"{job_id}-{export.format}" + (f"-{export.quantization}" if export.quantization else "")
    if export.format == "gguf":
        found = sorted(src.glob("*.gguf"))
        if not found:
            raise NotFound(f"export {export_id}: the .gguf file is no longer on disk", param="export_id")
        return FileResponse(found[0], media_type="application/octet-stream", filename=f"{stem}.gguf")
    path = artifacts.build_archive(src, format, temporaries_dir(state.settings))
    return TemporaryFileResponse(path, media_type=artifacts.MEDIA_TYPES[format], filename=f"{stem}.{format}")


@router.get("/{job_id}/exports/{export_id:path}", include_in_schema=False)
def unknown_export(job_id: str, export_id: str) -> None:
    """Any other path under a job's exports (``..%2f..%2fetc``, ``a/b/download``): the one 404."""
    raise _unknown(job_id, export_id)


def _export(session: SessionDep, job_id: str, export_id: str) -> Export:
    """The job's export; an unknown or malformed id (``exp-000...``, ``..``, a NUL) is one 404."""
    if EXPORT_ID.fullmatch(export_id) is None:
        raise _unknown(job_id, export_id)
    return service.get_export(session, job_id, export_id)


def _unknown(job_id: str, export_id: str) -> NotFound:
    """``core.exports.service.get_export``'s own 404, for the ids it is never asked about."""
    return NotFound(f"export {shown(export_id)} of job {job_id} does not exist", param="export_id")


def _model_type(state: AppState, job: Job) -> str | None:
    """The base's ``config.json`` ``model_type``, the model resolved from the job's spec under this
    box's model root (never a path a worker reported in its job.json); None if unknown (a hub id)."""
    from core.errors import InvalidInput
    from core.jobs.model_source import resolve_model

    try:
        source = resolve_model(job.model, model_root=state.settings.model_root, allow_hub=state.settings.allow_hub_models)
        if source.kind != "local":
            return None
        return json.loads((Path(source.name_or_path) / "config.json").read_text()).get("model_type")
    except (InvalidInput, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _enqueue(state: AppState, export_id: str, host: str | None) -> None:
    try:
        enqueue_export(state.celery, export_id, host)
    except Exception as exc:  # noqa: BLE001 - the export stays queued; asking again re-sends it
        log.warning("export %s committed but not signalled to the workers (broker: %s)", export_id, exc)
