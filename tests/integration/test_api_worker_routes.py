"""Worker keys and the ``/v1/worker/`` routes against both stores (issue 17).

The remote worker's side is played by hand here: a ``worker`` row with the key's id, a job (or
export) claimed by it through ``core.jobs.service`` / ``core.exports.service``, then the
transfers a worker makes (worker/transfer.py makes them for real in tests/netns).
"""

from __future__ import annotations

import contextlib
import io
import socket
import tarfile
import time
import zipfile

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.workers.auth import WORKER_ONLY
from cli import worker_keys as cli_keys
from core.exports import service as exports
from core.jobs import service
from core.jobs.models import Checkpoint
from core.jobs.states import JobStatus
from core.settings import Settings
from tests.fixtures.worker_routes import add_worker, claimed_job, put, sha, store_tree
from tests.integration.helpers import bearer, make_user, make_worker_key, serve, spec, upload

pytestmark = pytest.mark.integration


def tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def box(client: TestClient, store) -> dict[str, str]:
    """Two remote machines with their own keys; a job running on the first."""
    keys = {"box-2": make_worker_key(store, "box-2"), "box-3": make_worker_key(store, "box-3")}
    add_worker(store, "w@box-2", keys["box-2"])
    add_worker(store, "w@box-3", keys["box-3"])
    return {**keys, "job": claimed_job(client, store, "w@box-2")}


class TestKeysApi:
    def test_create_list_revoke(self, client: TestClient, store) -> None:
        created = client.post("/v1/workers/keys", json={"name": "box-2"})
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["key"].startswith(f"ftqw_{body['prefix']}_") and body["name"] == "box-2"
        add_worker(store, "w@box-2", body["key"])
        listed = client.get("/v1/workers/keys").json()["data"]
        assert [(k["name"], k["workers"], k["revoked_at"]) for k in listed] == [("box-2", ["w@box-2"], None)]
        assert "key" not in listed[0] and body["key"] not in client.get("/v1/workers/keys").text
        again = client.post("/v1/workers/keys", json={"name": "box-2"})
        assert again.status_code == 409 and again.json()["error"]["param"] == "name"
        bad = client.post("/v1/workers/keys", json={"name": "Box 2"})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "name"
        revoked = client.delete("/v1/workers/keys/box-2")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"]
        assert client.delete(f"/v1/workers/keys/{body['prefix']}").json()["revoked_at"] == revoked.json()["revoked_at"]
        assert client.delete("/v1/workers/keys/nope").status_code == 404

    def test_only_admins_manage_worker_keys(self, client: TestClient, store) -> None:
        alice = bearer(make_user(store, "alice"))
        for method, path in [("POST", "/v1/workers/keys"), ("GET", "/v1/workers/keys"),
                             ("DELETE", "/v1/workers/keys/x")]:
            response = client.request(method, path, json={"name": "x"}, headers=alice)
            assert response.status_code == 403, (method, path, response.text)

    def test_the_cli_makes_lists_and_revokes_through_the_api(
        self, client: TestClient, store, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
    ) -> None:
        monkeypatch.setattr(cli_keys, "connect", lambda: contextlib.nullcontext(client))
        from cli.main import main

        assert main(["workers", "key", "create", "box-9"]) == 0
        out = capsys.readouterr().out
        raw = next(word for word in out.split() if word.startswith("ftqw_"))
        assert main(["workers", "key", "list"]) == 0
        listing = capsys.readouterr().out
        assert "box-9" in listing and "active" in listing and raw not in listing
        assert main(["workers", "key", "revoke", "box-9"]) == 0
        assert "revoked worker key box-9" in capsys.readouterr().out
        assert main(["workers", "key", "list"]) == 0
        assert "revoked" in capsys.readouterr().out
        refused = client.get("/v1/worker/files/file-x", headers=bearer(raw))
        assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]


class TestDatasets:
    def test_the_running_jobs_dataset_comes_with_its_sha256(self, client: TestClient, store, box) -> None:
        with store.sessions() as session:
            file_id = service.get_job(session, box["job"]).training_file_id
        response = client.get(f"/v1/worker/files/{file_id}", headers=bearer(box["box-2"]))
        assert response.status_code == 200, response.text
        assert response.headers["X-Ftq-Sha256"] == sha(response.content)
        assert int(response.headers["Content-Length"]) == len(response.content) > 0
        other = client.get(f"/v1/worker/files/{file_id}", headers=bearer(box["box-3"]))
        assert other.status_code == 403 and other.json()["error"]["param"] == "file_id"
        assert client.get("/v1/worker/files/file-nope", headers=bearer(box["box-2"])).status_code == 404


    def test_a_converted_upload_is_served_with_the_sha256_of_the_bytes_served(
        self, client: TestClient, store, box
    ) -> None:
        sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
        file_id = upload(client, record=sharegpt)
        job = client.post("/v1/jobs", json=spec(file_id)).json()["id"]
        with store.sessions() as session:
            assert service.transition(session, job, JobStatus.running, worker_id="w@box-2")
            session.commit()
        response = client.get(f"/v1/worker/files/{file_id}", headers=bearer(box["box-2"]))
        assert response.status_code == 200 and b"messages" in response.content
        assert response.headers["X-Ftq-Sha256"] == sha(response.content)
        assert response.headers["X-Ftq-Sha256"] != client.get(f"/v1/files/{file_id}").json()["sha256"]


class TestUpload:
    def test_a_checkpoint_goes_up_and_the_dashboards_download_serves_it(
        self, client: TestClient, store, settings: Settings, box
    ) -> None:
        job = box["job"]
        body = tar_of({"state.json": b'{"step": 2}', "dcp/0.distcp": b"\x01" * 5000})
        stored = put(client, job, "checkpoints/step-000002", body, box["box-2"])
        assert stored.status_code == 201, stored.text
        assert stored.json() == {"path": "checkpoints/step-000002", "sha256": sha(body), "bytes": len(body), "files": 2}
        assert [p for p in store_tree(settings, job) if not p.startswith(".incoming")] == [
            "checkpoints", "checkpoints/step-000002", "checkpoints/step-000002/dcp",
            "checkpoints/step-000002/dcp/0.distcp", "checkpoints/step-000002/state.json"]
        assert [p.name for p in (settings.jobs_dir / job / ".incoming").iterdir()] == [".lock"]
        with store.sessions() as session:  # the worker records the row once the upload succeeded
            session.add(Checkpoint(job_id=job, step=2, path="/elsewhere/on/box-2", bytes=5011, final=False))
            session.commit()
        with zipfile.ZipFile(io.BytesIO(client.get(f"/v1/jobs/{job}/checkpoints/2/download").content)) as zf:
            assert sorted(zf.namelist()) == ["dcp/0.distcp", "state.json"]
        down = client.get(f"/v1/worker/jobs/{job}/artifacts/checkpoints/step-000002", headers=bearer(box["box-2"]))
        assert down.status_code == 200 and down.headers["content-type"] == "application/x-tar"
        assert down.headers["X-Ftq-Sha256"] == sha(down.content)
        with tarfile.open(fileobj=io.BytesIO(down.content)) as tar:
            assert sorted(tar.getnames()) == ["dcp/0.distcp", "state.json"]
            assert tar.extractfile("dcp/0.distcp").read() == b"\x01" * 5000

    def test_an_upload_replaces_the_artifact_whole(self, client: TestClient, settings: Settings, box) -> None:
        job = box["job"]
        assert put(client, job, "adapter", tar_of({"a.bin": b"1", "old.bin": b"2"}), box["box-2"]).status_code == 201
        assert put(client, job, "adapter", tar_of({"a.bin": b"3"}), box["box-2"]).status_code == 201
        adapter = settings.jobs_dir / job / "adapter"
        assert [p.name for p in adapter.iterdir()] == ["a.bin"] and (adapter / "a.bin").read_bytes() == b"3"

    def test_job_json_is_one_file(self, client: TestClient, settings: Settings, box) -> None:
        job = box["job"]
        assert put(client, job, "job.json", tar_of({"job.json": b"{}"}), box["box-2"]).status_code == 201
        assert (settings.jobs_dir / job / "job.json").read_bytes() == b"{}"
        two = put(client, job, "job.json", tar_of({"job.json": b"{}", "x": b""}), box["box-2"])
        assert two.status_code == 422 and two.json()["error"]["param"] == "body"

    def test_a_wrong_sha256_is_422_and_leaves_nothing(self, client: TestClient, settings: Settings, box) -> None:
        job, body = box["job"], tar_of({"state.json": b"{}"})
        response = put(client, job, "checkpoints/step-000004", body, box["box-2"], **{"X-Ftq-Sha256": "0" * 64})
        assert response.status_code == 422 and response.json()["error"]["code"] == "checksum_mismatch"
        assert store_tree(settings, job) == [".incoming"]
        for header in ({"X-Ftq-Sha256": "xyz"}, {"X-Ftq-Sha256": ""}):
            bad = put(client, job, "checkpoints/step-000004", body, box["box-2"], **header)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Ftq-Sha256"

    def test_a_body_shorter_than_announced_is_refused_and_leaves_nothing(
        self, client: TestClient, settings: Settings, box
    ) -> None:
        job, body = box["job"], tar_of({"state.json": b"{}" * 1000})
        response = client.put(
            f"/v1/worker/jobs/{job}/artifacts/checkpoints/step-000006", content=body[: len(body) // 2],
            headers={**bearer(box["box-2"]), "X-Ftq-Sha256": sha(body), "Content-Length": str(len(body))},
        )
        assert response.status_code in (400, 422), response.text
        assert not (settings.jobs_dir / job / "checkpoints").exists()
        assert list((settings.jobs_dir / job / ".incoming").iterdir()) == []

    @pytest.mark.parametrize("path", ["..%2Fjob-x%2Fadapter", "%2E%2E", "checkpoints%2F..%2F..%2Fx",
                                      "checkpoints/step-000002.tmp", "unrecorded-checkpoints", "%2Fetc%2Fpasswd",
                                      "adapter/extra", ".incoming"])
    def test_paths_outside_the_layout_are_422(self, client: TestClient, settings: Settings, box, path: str) -> None:
        response = put(client, box["job"], path, tar_of({"x": b"x"}), box["box-2"])
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"]["param"] == "path"
        assert store_tree(settings, box["job"]) == []

    def test_a_tar_escaping_its_directory_is_422(self, client: TestClient, settings: Settings, box) -> None:
        for name in ("../../escaped", "/abs", "a/../../../escaped"):
            response = put(client, box["job"], "adapter", tar_of({name: b"x"}), box["box-2"])
            assert response.status_code == 422 and response.json()["error"]["code"] == "unsafe_archive", name
        assert not (settings.jobs_dir / "escaped").exists() and not (settings.jobs_dir / box["job"] / "adapter").exists()
        assert [p.name for p in (settings.jobs_dir / box["job"] / ".incoming").iterdir()] == [".lock"]


class TestWhoMayMoveWhat:
    def test_another_keys_job_is_403_and_a_revoked_key_401(self, client: TestClient, store, box) -> None:
        job, body = box["job"], tar_of({"a": b"a"})
        assert put(client, job, "adapter", body, box["box-3"]).status_code == 403
        other = client.get(f"/v1/worker/jobs/{job}/artifacts/adapter", headers=bearer(box["box-3"]))
        assert other.status_code == 403 and other.json()["error"]["param"] == "job_id"
        client.delete("/v1/workers/keys/box-2").raise_for_status()
        revoked = put(client, job, "adapter", body, box["box-2"])
        assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]

    def test_a_machine_of_a_multi_machine_jobs_attempt_may_move_its_files_while_its_part_runs(
        self, client: TestClient, store, box
    ) -> None:
        from core.db import utcnow
        from core.jobs.models import Job, JobNode

        job, three = box["job"], bearer(box["box-3"])
        url = f"/v1/worker/jobs/{job}/artifacts/job.json"
        put(client, job, "job.json", tar_of({"job.json": b"{}"}), box["box-2"]).raise_for_status()
        assert client.get(url, headers=three).status_code == 403
        with store.sessions() as session:
            attempt = session.get(Job, job).attempts
            session.add(JobNode(job_id=job, attempt=attempt - 1, node_rank=1, worker_id="w@box-3", address="b",
                                rdzv_endpoint="a:1"))  # an earlier attempt's machine
            session.commit()
        assert client.get(url, headers=three).status_code == 403
        with store.sessions() as session:
            session.add(JobNode(job_id=job, attempt=attempt, node_rank=1, worker_id="w@box-3", address="b",
                                rdzv_endpoint="a:1"))
            session.commit()
        assert client.get(url, headers=three).status_code == 200
        with store.sessions() as session:
            session.get(JobNode, (job, attempt, 1)).ended_at = utcnow()
            session.commit()
        assert client.get(url, headers=three).status_code == 403

    def test_a_finished_job_is_no_longer_reachable(self, client: TestClient, store, box) -> None:
        with store.sessions() as session:
            assert service.transition(session, box["job"], JobStatus.failed)
            session.commit()
        assert put(client, box["job"], "adapter", tar_of({"a": b"a"}), box["box-2"]).status_code == 403

    def test_user_keys_on_worker_routes_and_worker_keys_on_user_routes_are_403(
        self, client: TestClient, admin_key: str, box
    ) -> None:
        job = box["job"]
        user = client.get(f"/v1/worker/jobs/{job}/artifacts/adapter", headers=bearer(admin_key))
        assert user.status_code == 403 and "only worker keys" in user.json()["error"]["message"]
        jobs = client.get("/v1/jobs", headers=bearer(box["box-2"]))
        assert jobs.status_code == 403 and jobs.json()["error"]["message"] == WORKER_ONLY
        assert client.get(f"/v1/jobs/{job}", headers=bearer(box["box-2"])).status_code == 403

    def test_an_exports_worker_reads_the_job_and_writes_only_its_export(
        self, client: TestClient, store, settings: Settings, box
    ) -> None:
        job = box["job"]
        put(client, job, "adapter", tar_of({"adapter.bin": b"w"}), box["box-2"]).raise_for_status()
        with store.sessions() as session:
            assert service.transition(session, job, JobStatus.succeeded)
            export, _ = exports.create_export(session, job, "merged", None, owner_id=None, model_type=None)
            assert exports.claim(session, export.export_id, "w@box-3")
            session.commit()
            export_id = export.export_id
        three = bearer(box["box-3"])
        assert client.get(f"/v1/worker/jobs/{job}/artifacts/adapter", headers=three).status_code == 200
        assert put(client, job, f"exports/{export_id}", tar_of({"m.safetensors": b"m"}), box["box-3"]).status_code == 201
        assert (settings.jobs_dir / job / "exports" / export_id / "m.safetensors").read_bytes() == b"m"
        assert put(client, job, "adapter", tar_of({"x": b"x"}), box["box-3"]).status_code == 403
        unknown = put(client, job, "exports/exp-0000", tar_of({"x": b"x"}), box["box-3"])
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "path"


@pytest.mark.slow
def test_a_connection_cut_mid_upload_leaves_nothing(store, settings: Settings, admin_key: str) -> None:
    """Real uvicorn: the worker's connection dies half-way through the body."""
    key = make_worker_key(store, "box-2")
    add_worker(store, "w@box-2", key)
    with TestClient(create_app(settings), headers=bearer(admin_key)) as client:
        job = claimed_job(client, store, "w@box-2")
    body = tar_of({"big.bin": b"\x02" * 200_000})
    with serve(settings) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = (f"PUT /v1/worker/jobs/{job}/artifacts/checkpoints/step-000008 HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {key}\r\nX-Ftq-Sha256: {sha(body)}\r\nContent-Length: {len(body)}\r\n\r\n")
        sock.sendall(head.encode() + body[:50_000])
        time.sleep(0.2)
        sock.close()
        incoming = settings.jobs_dir / job / ".incoming"
        deadline = time.monotonic() + 10
        while (not incoming.exists() or any(incoming.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert incoming.exists() and list(incoming.iterdir()) == []
    assert not (settings.jobs_dir / job / "checkpoints").exists()
