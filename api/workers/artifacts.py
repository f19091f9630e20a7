"""``/v1/worker/``: the bytes a worker on another machine moves, under a worker key only.

- ``GET /v1/worker/files/{file_id}``: a dataset of a job the worker runs, streamed.
- ``GET /v1/worker/jobs/{job_id}/artifacts/{path}``: a tar of ``<jobs_dir>/<job_id>/<path>``.
- ``PUT /v1/worker/jobs/{job_id}/artifacts/{path}``: such a tar, stored atomically.

Each answer or upload carries ``X-Ftq-Sha256`` (the sha256 of its bytes) and a length, so a
truncated or corrupted transfer is detected on either side and sent again. An upload is streamed
to ``<jobs_dir>/<job_id>/.incoming/`` and hashed as it arrives (never held in memory); only a
whole, matching, safe tar (``core.workers.archive``) is unpacked into a staging directory there
and renamed into place, so nothing half-uploaded is ever at ``<path>``. ``path`` is one of
``trainer.layout.ARTIFACT_PATHS``; the key must belong to the worker running the job
(``core.workers.access``). An upload is bounded (``core.workers.uploads``): a checkpoint's step
by the job's progress and last step, a recorded checkpoint is never replaced, and the tar by a
member count and the job's quota, counted as the body arrives and again as it is unpacked. A
download's tar is a temporary file removed however the response ends (``api.responses``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from anyio import to_thread
from fastapi import APIRouter, Request, status
from fastapi.responses import FileResponse, JSONResponse
from starlette.requests import ClientDisconnect

from api.deps import SessionDep, StateDep
from api.errors import error_body
from api.responses import TemporaryFileResponse, temporaries_dir
from api.state import AppState
from api.workers.auth import WorkerCaller, WorkerDep
from api.workers.schemas import ArtifactStored
from core.errors import ChecksumMismatch, InvalidInput, NotFound
from core.jobs import artifact_store
from core.settings import Settings
from core.workers import access, archive, uploads
from trainer.training import layout

router = APIRouter(prefix="/v1/worker", tags=["worker"])
SHA_HEADER = "X-Ftq-Sha256"
TAR = "application/x-tar"


def _checked_path(path: str) -> str:
    try:
        return layout.check_artifact_path(path)
    except ValueError as exc:
        raise InvalidInput(str(exc), param="path") from None


def _authorise(state: AppState, worker: WorkerCaller, job_id: str, path: str, *, upload: bool) -> None:
    with state.sessions() as session:
        access.check_job_access(session, worker.worker_key_id, job_id, path, upload=upload)


@router.get(
    "/files/{file_id}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
    summary="A dataset of a job this worker runs (worker key)",
)
def download_file(file_id: str, worker: WorkerDep, session: SessionDep) -> FileResponse:
    row = access.check_file_access(session, worker.worker_key_id, file_id)
    path, converted = Path(row.path), "converted_from" in (row.stats or {})
    session.close()
    if not path.is_file():
        raise NotFound(f"file {file_id}: its bytes are no longer on disk", param="file_id")
    # A converted upload is stored as chat messages; its row's sha256 is the upload's.
    digest = _file_sha256(path) if converted else row.sha256
    return FileResponse(path, media_type="application/octet-stream", headers={SHA_HEADER: digest})


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(archive.CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@router.get(
    "/jobs/{job_id}/artifacts/{path:path}",
    response_class=FileResponse,
    responses={200: {"content": {TAR: {}}}},
    summary="A tar of one of a job's artifacts (worker key of the worker running it)",
)
async def download_artifact(job_id: str, path: str, worker: WorkerDep, state: StateDep) -> FileResponse:
    path = _checked_path(path)
    await to_thread.run_sync(lambda: _authorise(state, worker, job_id, path, upload=False))
    out, digest = await to_thread.run_sync(_pack, state.settings, job_id, path)
    return TemporaryFileResponse(out, media_type=TAR, headers={SHA_HEADER: digest})


def _pack(settings: Settings, job_id: str, path: str) -> tuple[Path, str]:
    src = artifact_store.artifact_path(settings, job_id, path)
    root = artifact_store.job_store_dir(settings, job_id)
    if not src.exists() or not src.resolve().is_relative_to(root.resolve()):
        raise NotFound(f"job {job_id} has no {path!r} in the API's artifact store", param="path")
    tmp_dir = temporaries_dir(settings)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=tmp_dir, suffix=".tar")
    os.close(fd)
    out = Path(name)
    try:
        digest, _size = archive.write_tar(src, out)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out, digest


@router.put(
    "/jobs/{job_id}/artifacts/{path:path}",
    status_code=status.HTTP_201_CREATED,
    # Documented as octet-stream (what clients and fuzzers know how to send); the bytes are a tar.
    openapi_extra={"requestBody": {"description": "an uncompressed tar (application/x-tar)", "required": True,
                                   "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                      "format": "binary"}}}}},
    summary="Store one of a job's artifacts from a tar, atomically (worker key of the worker running it)",
)
async def upload_artifact(
    job_id: str, path: str, request: Request, worker: WorkerDep, state: StateDep
) -> ArtifactStored:
    path = _checked_path(path)
    try:
        sha256 = archive.check_sha256_header(request.headers.get(SHA_HEADER))
    except ValueError as exc:
        return JSONResponse(error_body("invalid_header", str(exc), param=SHA_HEADER), status_code=400)  # type: ignore[return-value]
    expected = _content_length(request)
    quota = await to_thread.run_sync(lambda: _admit(state, worker, job_id, path))
    incoming = artifact_store.incoming_dir(state.settings, job_id)
    await to_thread.run_sync(lambda: incoming.mkdir(parents=True, exist_ok=True))
    received = incoming / f"{uuid.uuid4().hex}.tar"
    try:
        if expected is not None:
            await to_thread.run_sync(quota.check_body, incoming, received, expected)
        got = await _receive(request, received, quota)
        return await to_thread.run_sync(
            lambda: _store(state, worker, job_id, path, received, sha256=sha256, got=got, expected=expected)
        )
    finally:
        received.unlink(missing_ok=True)


def _admit(state: AppState, worker: WorkerCaller, job_id: str, path: str) -> uploads.Quota:
    """The key may write ``path`` of the job now (``core.workers.access``), a checkpoint's step is
    one the job can have reached and not recorded yet (``core.workers.uploads``); the job's quota."""
    with state.sessions() as session:
        job = access.check_job_access(session, worker.worker_key_id, job_id, path, upload=True)
        uploads.check_upload(session, job, path)
    return uploads.Quota.measure(state.settings, job_id, path)


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidInput("Content-Length: must be a number of bytes", param="Content-Length")
    return int(value)


QUOTA_CHECK_BYTES = 64 << 20
"""While a body arrives, the bytes of the job's uploads in flight are measured again this often."""


async def _receive(request: Request, out: Path, quota: uploads.Quota) -> str:
    """Stream the request body into ``out``, hashing it; the hex sha256 of what arrived.

    Raises:
        TooLarge: the job's uploads in flight pass its quota (``uploads.Quota.check_body``).
    """
    digest = hashlib.sha256()
    received = checked = 0
    with out.open("wb") as fh:
        try:
            async for chunk in request.stream():
                digest.update(chunk)
                await to_thread.run_sync(fh.write, chunk)
                received += len(chunk)
                if received - checked >= QUOTA_CHECK_BYTES:
                    checked = received
                    await to_thread.run_sync(quota.check_body, out.parent, out, received)
        except ClientDisconnect:
            raise ChecksumMismatch("body: the connection closed before the whole body arrived; send it again",
                                   param="body") from None
    return digest.hexdigest()


def _store(state: AppState, worker: WorkerCaller, job_id: str, path: str, received: Path, *, sha256: str,
           got: str, expected: int | None) -> ArtifactStored:
    """Verify what arrived, then, holding the job's store lock, check the upload again (the job may
    have ended, the checkpoint been recorded, other uploads landed meanwhile), unpack it within
    the quota and rename it into place."""
    settings = state.settings
    size = archive.verify_received(received, sha256=sha256, got_sha256=got, expected_bytes=expected)
    incoming = received.parent
    staging = incoming / f"{received.stem}.d"
    with artifact_store.job_lock(settings, job_id):
        quota = _admit(state, worker, job_id, path)
        try:
            files = archive.extract_into(received, staging, quota.limits())
            source = staging
            if path in (layout.JOB_CONFIG, layout.COMPLETIONS):  # one file, not a directory
                source = staging / path
                if files != 1 or not source.is_file() or source.is_symlink():
                    raise InvalidInput(f"body: the tar of {path} must hold that one file, named {path!r}",
                                       param="body")
            archive.replace_atomically(source, artifact_store.artifact_path(settings, job_id, path), incoming)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return ArtifactStored(path=path, sha256=sha256, bytes=size, files=files)
