"""Bytes between a remote worker and the API's artifact store, over HTTP with a worker key.

A worker with ``FTQ_WORKER_KEY`` shares no disk with the API (core/settings.py): it fetches
datasets and job artifacts from, and uploads checkpoints, adapters and exports to, the API's
``/v1/worker/`` routes. Every transfer is streamed and checked against a sha256:

    fetch_file         GET /v1/worker/files/{id} → ``<cache>/<sha256>`` (temp file, verified,
                       renamed; a file already cached under its hash is not fetched again)
    download_artifact  GET /v1/worker/jobs/{job}/artifacts/{path} → a tar, verified, extracted
                       into a temporary directory beside the target, then renamed into place
    upload_artifact    a directory (or one file) → a tar in a temporary file (written by the
                       API's own writer, ``core.workers.archive.write_tar``, its sha256 computed
                       on the way), then PUT /v1/worker/jobs/{job}/artifacts/{path} streaming it

A checksum mismatch, a truncated body, a 5xx or a connection error is retried up to
``retries`` times with exponential backoff; a 401 or 403 (a revoked or wrong key, a job that
is not this worker's) is not: ``TransferRefused`` says why. A tar from the network is trusted
no more than an upload: it is read by the API's own reader (``core.workers.archive``), which
refuses absolute names, ``..``, links, devices, fifos and sparse files.

Errors::

    TransferError           the transfer failed for good (retries used up, 4xx, bad archive)
      TransferRefused       401/403: the key is revoked or unknown, or the job is not ours
      TransferNotFound      404: the file or artifact does not exist on the API
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from core.errors import InvalidInput
from core.workers import archive as tars

log = logging.getLogger(__name__)

CHUNK = 1 << 20
SHA_HEADER = "X-Ftq-Sha256"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
T = TypeVar("T")


READ_WAIT_S = 1800.0
"""Longest wait for the API's answer (or the next bytes of it) during one transfer."""


class TransferError(Exception):
    """A transfer that failed for good; the message says what and why."""


class TransferRefused(TransferError):
    """The API refused the worker key (401) or the job is not this worker's (403)."""


class TransferNotFound(TransferError):
    """The API has no such file or artifact (404).

    ``what`` names it as the worker asked for it (``dataset file-…``, ``checkpoints/step-000040 of
    job job-…``): a missing dataset fails the job for good, a missing checkpoint does not
    (worker/remote.py), so the caller must be able to tell them apart and say which.
    """

    def __init__(self, message: str, what: str = "") -> None:
        super().__init__(message)
        self.what = what


class _Retry(Exception):
    """A failure worth another try (checksum mismatch, truncated body, 5xx, connection error)."""


class TransferClient:
    """One API, one worker key; thread-safe (httpx.Client is)."""

    def __init__(
        self,
        api_url: str,
        worker_key: str,
        *,
        retries: int = 4,
        backoff_s: float = 0.5,
        timeout_s: float = 60.0,
        tmp_dir: Path | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retries = retries
        self.backoff_s = backoff_s
        self.tmp_dir = tmp_dir
        """Where upload tars and download temporaries go (default: the system's temp dir)."""
        self._client = httpx.Client(
            base_url=api_url.rstrip("/"),
            headers={"Authorization": f"Bearer {worker_key}"},
            # The API answers a download only once it has packed the tar, and an upload once it has
            # verified and unpacked it: tens of GB for a full model take minutes before the first
            # byte, so a read may wait that long (a stalled connection still ends, at READ_WAIT_S).
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0), read=max(timeout_s, READ_WAIT_S)),
            transport=transport,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TransferClient:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # -- datasets ---------------------------------------------------------------------------

    def fetch_file(self, file_id: str, cache_dir: Path, *, sha256: str | None = None) -> Path:
        """The dataset ``file_id`` as ``<cache_dir>/<sha256>``; fetched only when not cached.

        ``sha256`` (the files table's) lets a cached copy be used without asking the API.
        """
        if sha256 and (cache_dir / sha256).is_file():
            return cache_dir / sha256
        cache_dir.mkdir(parents=True, exist_ok=True)

        def once() -> Path:
            with self._client.stream("GET", f"/v1/worker/files/{file_id}") as response:
                _check_status(response, f"dataset {file_id}")
                expected = _expected_sha(response, f"dataset {file_id}")
                if sha256 and expected != sha256:
                    raise TransferError(f"dataset {file_id}: the API sent sha256 {expected}, the store says {sha256}")
                target = cache_dir / expected
                if target.is_file():
                    return target
                tmp = cache_dir / f".{expected}.{uuid.uuid4().hex}.part"
                try:
                    _receive(response, tmp, expected, f"dataset {file_id}")
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
                return target

        return self._with_retries(f"download of dataset {file_id}", once)

    # -- job artifacts ----------------------------------------------------------------------

    def download_artifact(self, job_id: str, path: str, dest: Path) -> Path:
        """Fetch ``<job>/<path>`` and put its contents at ``dest`` (a directory; or, for a single
        file like ``job.json``, the file itself), replacing what was there. Atomic: ``dest`` is
        either the old or the complete new contents."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        what = f"{path} of job {job_id}"

        def once() -> Path:
            with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.incoming-") as work:
                tar = Path(work) / "artifact.tar"
                with self._client.stream("GET", f"/v1/worker/jobs/{job_id}/artifacts/{path}") as response:
                    _check_status(response, what)
                    _receive(response, tar, _expected_sha(response, what), what)
                tree = Path(work) / "tree"
                safe_extract(tar, tree)
                if _single_file(path):
                    members = list(tree.iterdir())
                    if len(members) != 1 or not members[0].is_file():
                        raise TransferError(f"{what}: expected one file in the archive, found {len(members)} entries")
                    _replace(members[0], dest)
                else:
                    _replace(tree, dest)
            return dest

        return self._with_retries(f"download of {what}", once)

    def upload_artifact(self, job_id: str, path: str, source: Path) -> dict[str, Any]:
        """Send ``source`` (a directory, or one file) as ``<job>/<path>`` on the API; returns the
        API's answer ({"path", "sha256", "bytes", "files"}). The tar is written once to a
        temporary file (its sha256 computed on the way) and streamed from it on each try."""
        what = f"{path} of job {job_id}"
        if not source.exists():
            raise TransferError(f"upload of {what}: {source} does not exist")
        fd, name = tempfile.mkstemp(prefix="ftq-upload-", suffix=".tar", dir=self.tmp_dir)
        os.close(fd)
        tar = Path(name)
        try:
            digest, size = tars.write_tar(source, tar)

            def once() -> dict[str, Any]:
                headers = {SHA_HEADER: digest, "Content-Length": str(size), "Content-Type": "application/x-tar"}
                response = self._client.put(
                    f"/v1/worker/jobs/{job_id}/artifacts/{path}", content=_chunks(tar), headers=headers
                )
                _check_status(response, what, upload=True)
                return dict(response.json())

            return self._with_retries(f"upload of {what}", once)
        finally:
            tar.unlink(missing_ok=True)

    # -- retries ----------------------------------------------------------------------------

    def _with_retries(self, what: str, once: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return once()
            except (_Retry, httpx.TransportError) as exc:
                if attempt == self.retries:
                    raise TransferError(f"{what} failed after {attempt + 1} tries: {exc}") from exc
                delay = min(30.0, self.backoff_s * 2**attempt)
                log.warning("%s failed (try %d of %d): %s; again in %.1fs", what, attempt + 1,
                            self.retries + 1, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


def _check_status(response: httpx.Response, what: str, *, upload: bool = False) -> None:
    code = response.status_code
    if code < 400:
        return
    detail = _detail(response)
    if code in (401, 403):
        raise TransferRefused(f"{what}: the API refused this worker ({code}: {detail}); check FTQ_WORKER_KEY "
                              "(revoked? `ftq workers key list` on the API's machine)")
    if code == 404:
        raise TransferNotFound(f"{what}: not on the API (404: {detail})", what)
    if code >= 500 or code in (408, 429) or (upload and code == 422 and "checksum_mismatch" in detail):
        raise _Retry(f"{code}: {detail}")
    raise TransferError(f"{what}: the API answered {code}: {detail}")


def _detail(response: httpx.Response) -> str:
    try:
        response.read()
        return response.text[:500]
    except httpx.HTTPError:
        return "(no body)"


def _expected_sha(response: httpx.Response, what: str) -> str:
    value = response.headers.get(SHA_HEADER, "").lower()
    if not _HEX64.match(value):
        raise _Retry(f"{what}: the answer has no valid {SHA_HEADER} header ({value!r})")
    return value


def _receive(response: httpx.Response, target: Path, expected: str, what: str) -> None:
    """Stream the body into ``target``, hashing it; a short body or another hash is a _Retry."""
    digest = hashlib.sha256()
    size = 0
    with target.open("wb") as sink:
        for chunk in response.iter_bytes(CHUNK):
            digest.update(chunk)
            sink.write(chunk)
            size += len(chunk)
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) != size:
        raise _Retry(f"{what}: truncated body ({size} of {length} bytes)")
    if digest.hexdigest() != expected:
        raise _Retry(f"{what}: checksum mismatch (got sha256 {digest.hexdigest()}, expected {expected})")


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as source:
        while chunk := source.read(CHUNK):
            yield chunk


def _single_file(path: str) -> bool:
    """Artifact paths naming one file rather than a directory (``job.json``, logs)."""
    return Path(path).suffix in (".json", ".log", ".jsonl", ".txt")


def _replace(source: Path, dest: Path) -> None:
    """Rename ``source`` to ``dest``; an existing ``dest`` is renamed aside first, then removed."""
    aside = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex}")
    had = dest.exists() or dest.is_symlink()
    if had:
        os.replace(dest, aside)
    os.replace(source, dest)
    if had:
        shutil.rmtree(aside) if aside.is_dir() and not aside.is_symlink() else aside.unlink()


def safe_extract(archive: Path, dest: Path) -> None:
    """Extract ``archive`` into the new directory ``dest`` with the API's own reader
    (``core.workers.archive.extract_into``): absolute or ``..`` names, links, devices, fifos,
    sparse files and more than its member cap are refused before a byte is written."""
    try:
        tars.extract_into(archive, dest)
    except InvalidInput as exc:
        raise TransferError(f"unsafe archive: {exc.message.removeprefix('body: ')}") from None
