"""worker/transfer.py against a tiny local HTTP server that misbehaves on purpose."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.hostile_tars import HOSTILE
from worker.transfer import (
    TransferClient,
    TransferError,
    TransferNotFound,
    TransferRefused,
    safe_extract,
)

KEY = "ftqw_0123abcd_secret"


class FakeApi:
    """Serves ``files`` (id → bytes) and ``artifacts`` ((job, path) → tar bytes); each request
    pops the next entry of ``faults`` (``corrupt``, ``truncate``, ``500``, ``403``) if any."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.artifacts: dict[tuple[str, str], bytes] = {}
        self.uploads: list[tuple[str, str, str, bytes]] = []
        self.faults: list[str] = []
        self.requests: list[str] = []
        self.auth: list[str | None] = []


def _handler(api: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def _fault(self) -> str | None:
            api.requests.append(f"{self.command} {self.path}")
            api.auth.append(self.headers.get("Authorization"))
            return api.faults.pop(0) if api.faults else None

        def _status(self, code: int, body: bytes = b"{}") -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            fault = self._fault()
            parts = self.path.strip("/").split("/")
            if parts[:3] == ["v1", "worker", "files"]:
                body = api.files.get(parts[3])
            else:
                body = api.artifacts.get((parts[3], "/".join(parts[5:])))
            if fault in ("500", "403"):
                return self._status(int(fault), b'{"error": {"message": "no"}}')
            if body is None:
                return self._status(404)
            sha = hashlib.sha256(body).hexdigest()
            self.send_response(200)
            self.send_header("X-Ftq-Sha256", sha)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault == "corrupt":
                body = bytes([body[0] ^ 1]) + body[1:]
            if fault == "truncate":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

        def do_PUT(self) -> None:  # noqa: N802
            fault = self._fault()
            body = self.rfile.read(int(self.headers["Content-Length"]))
            parts = self.path.strip("/").split("/")
            sha = self.headers.get("X-Ftq-Sha256")
            if fault in ("500", "403"):
                return self._status(int(fault))
            if fault == "corrupt" or hashlib.sha256(body).hexdigest() != sha:
                return self._status(422, b'{"error": {"code": "checksum_mismatch"}}')
            api.uploads.append((parts[3], "/".join(parts[5:]), sha, body))
            self._status(201, b'{"path": "x", "files": 1}')

    return Handler


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    fake = FakeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _client(url: str, tmp_path: Path, retries: int = 3) -> TransferClient:
    return TransferClient(url, KEY, retries=retries, backoff_s=0.01, timeout_s=10, tmp_dir=tmp_path)


def _tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_fetch_file_retries_a_checksum_mismatch_then_caches_by_hash(api, tmp_path):
    fake, url = api
    data = b'{"messages": []}\n' * 100
    fake.files["file-1"] = data
    fake.faults = ["corrupt"]
    cache = tmp_path / "cache"
    with _client(url, tmp_path) as client:
        path = client.fetch_file("file-1", cache)
    sha = hashlib.sha256(data).hexdigest()
    assert path == cache / sha and path.read_bytes() == data
    assert len(fake.requests) == 2
    assert fake.auth[0] == f"Bearer {KEY}"
    assert [p.name for p in cache.iterdir()] == [sha]  # no temp file left


def test_fetch_file_retries_a_truncated_body(api, tmp_path):
    fake, url = api
    fake.files["file-1"] = b"x" * 10_000
    fake.faults = ["truncate", "500"]
    with _client(url, tmp_path) as client:
        path = client.fetch_file("file-1", tmp_path / "cache")
    assert path.read_bytes() == b"x" * 10_000
    assert len(fake.requests) == 3


def test_fetch_file_cache_hit_asks_nothing(api, tmp_path):
    fake, url = api
    data = b"cached"
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / sha).write_bytes(data)
    with _client(url, tmp_path) as client:
        assert client.fetch_file("file-1", tmp_path / "cache", sha256=sha) == tmp_path / "cache" / sha
    assert fake.requests == []


def test_403_is_not_retried(api, tmp_path):
    fake, url = api
    fake.files["file-1"] = b"data"
    fake.faults = ["403"]
    with _client(url, tmp_path) as client, pytest.raises(TransferRefused, match="FTQ_WORKER_KEY"):
        client.fetch_file("file-1", tmp_path / "cache")
    assert len(fake.requests) == 1


def test_retries_are_bounded(api, tmp_path):
    fake, url = api
    fake.files["file-1"] = b"data"
    fake.faults = ["corrupt"] * 10
    with _client(url, tmp_path, retries=2) as client, pytest.raises(TransferError, match="after 3 tries"):
        client.fetch_file("file-1", tmp_path / "cache")
    assert len(fake.requests) == 3
    assert not any((tmp_path / "cache").iterdir())


def test_missing_artifact_is_not_found(api, tmp_path):
    _, url = api
    with _client(url, tmp_path) as client, pytest.raises(TransferNotFound):
        client.download_artifact("job-1", "adapter", tmp_path / "adapter")


def test_download_artifact_replaces_the_directory_atomically(api, tmp_path):
    fake, url = api
    fake.artifacts[("job-1", "checkpoints/step-000002")] = _tar_of({"a.bin": b"new", "sub/b.json": b"{}"})
    fake.faults = ["corrupt"]
    dest = tmp_path / "out" / "checkpoints" / "step-000002"
    dest.mkdir(parents=True)
    (dest / "stale").write_text("old")
    with _client(url, tmp_path) as client:
        client.download_artifact("job-1", "checkpoints/step-000002", dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == ["a.bin", "sub", "sub/b.json"]
    assert (dest / "a.bin").read_bytes() == b"new"
    assert [p.name for p in dest.parent.iterdir()] == ["step-000002"]  # no temporaries left


def test_download_single_file_artifact(api, tmp_path):
    fake, url = api
    fake.artifacts[("job-1", "job.json")] = _tar_of({"job.json": b'{"a": 1}'})
    with _client(url, tmp_path) as client:
        client.download_artifact("job-1", "job.json", tmp_path / "job" / "job.json")
    assert (tmp_path / "job" / "job.json").read_bytes() == b'{"a": 1}'


@pytest.mark.parametrize("name", ["../escape", "/etc/evil", "a/../../escape"])
def test_download_refuses_an_escaping_archive(api, tmp_path, name):
    fake, url = api
    fake.artifacts[("job-1", "adapter")] = _tar_of({"ok": b"1", name: b"2"})
    with _client(url, tmp_path) as client, pytest.raises(TransferError, match="unsafe archive"):
        client.download_artifact("job-1", "adapter", tmp_path / "job" / "adapter")
    assert len(fake.requests) == 1  # a hostile archive is not asked for again
    assert not (tmp_path / "job" / "adapter").exists()
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("hostile", HOSTILE, ids=lambda h: h.id)
def test_every_hostile_tar_the_api_could_send_is_refused_by_the_one_reader(api, tmp_path, hostile):
    fake, url = api
    fake.artifacts[("job-1", "adapter")] = hostile.build()
    with _client(url, tmp_path) as client, pytest.raises(TransferError, match=f"unsafe archive: .*{hostile.says}"):
        client.download_artifact("job-1", "adapter", tmp_path / "job" / "adapter")
    assert len(fake.requests) == 1  # a hostile archive is not asked for again
    assert [p.name for p in tmp_path.rglob("*")] == ["job"] and not Path("/etc/evil").exists()


def test_safe_extract_refuses_links(tmp_path):
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("link")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(TransferError, match="link"):
        safe_extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_safe_extract_is_the_apis_reader_and_refuses_a_sparse_member(tmp_path):
    from tests.hostile_tars import gnu_sparse_tar

    (tmp_path / "a.tar").write_bytes(gnu_sparse_tar())
    with pytest.raises(TransferError, match="unsafe archive: tar member 'big' is a sparse file"):
        safe_extract(tmp_path / "a.tar", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_upload_streams_a_tar_with_its_sha_and_retries_a_mismatch(api, tmp_path):
    fake, url = api
    source = tmp_path / "adapter"
    (source / "sub").mkdir(parents=True)
    (source / "adapter_model.safetensors").write_bytes(b"w" * 5000)
    (source / "sub" / "c.json").write_text("{}")
    fake.faults = ["corrupt", "500"]
    with _client(url, tmp_path) as client:
        answer = client.upload_artifact("job-1", "adapter", source)
    assert answer["files"] == 1
    ((job, path, sha, body),) = fake.uploads
    assert (job, path, sha) == ("job-1", "adapter", hashlib.sha256(body).hexdigest())
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert sorted(tar.getnames()) == ["adapter_model.safetensors", "sub/c.json"]
    assert len(fake.requests) == 3
    assert not list(tmp_path.glob("ftq-upload-*"))  # the temporary tar is gone


def test_upload_403_is_not_retried(api, tmp_path):
    fake, url = api
    (tmp_path / "job.json").write_text("{}")
    fake.faults = ["403"]
    with _client(url, tmp_path) as client, pytest.raises(TransferRefused):
        client.upload_artifact("job-1", "job.json", tmp_path / "job.json")
    assert len(fake.requests) == 1


def _uploaded_tar(api, tmp_path, source: Path) -> dict[str, bytes]:
    """Upload ``source`` to the fake API; the uploaded tar's members as name → bytes."""
    fake, url = api
    with _client(url, tmp_path) as client:
        client.upload_artifact("job-1", "adapter", source)
    ((*_, body),) = fake.uploads
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert all(m.isfile() and m.mode == 0o644 and not m.uname for m in tar.getmembers())
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_an_upload_of_one_file_names_it_by_basename(api, tmp_path):
    (tmp_path / "job.json").write_text("{}")
    assert _uploaded_tar(api, tmp_path, tmp_path / "job.json") == {"job.json": b"{}"}


def test_an_upload_stores_a_second_name_of_one_file_as_a_file_of_its_own(api, tmp_path):
    source = tmp_path / "adapter"
    source.mkdir()
    (source / "a.bin").write_bytes(b"weights")
    os.link(source / "a.bin", source / "b.bin")
    assert _uploaded_tar(api, tmp_path, source) == {"a.bin": b"weights", "b.bin": b"weights"}


def test_an_upload_leaves_links_out_and_never_follows_them(api, tmp_path):
    """The one writer's rule (``core.workers.archive.tree_members``), as for the API's downloads."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not the job's")
    source = tmp_path / "adapter"
    source.mkdir()
    (source / "a.bin").write_bytes(b"weights")
    (source / "to-file").symlink_to(outside / "secret")
    (source / "to-dir").symlink_to(outside, target_is_directory=True)
    assert _uploaded_tar(api, tmp_path, source) == {"a.bin": b"weights"}


def test_a_converted_dataset_is_checked_against_the_apis_hash_only():
    from types import SimpleNamespace

    from worker.remote import _stored_sha256

    assert _stored_sha256(SimpleNamespace(sha256="ab" * 32, stats={"records": 3})) == "ab" * 32
    assert _stored_sha256(SimpleNamespace(sha256="ab" * 32, stats={"converted_from": "sharegpt"})) is None
    assert _stored_sha256(SimpleNamespace(sha256="ab" * 32, stats=None)) == "ab" * 32
