"""Worker uploads are bounded (issue 23 item 9): each test sends the request that broke the API,
with a valid worker key for the job, against the real app's ``/v1/worker/`` routes."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.workers.sweeper import UploadSweeper
from core.exports import service as exports
from core.jobs import service
from core.jobs.models import Checkpoint, Job
from core.jobs.states import JobStatus
from core.settings import Settings
from tests.fixtures.worker_routes import add_worker, claimed_job, put, sha, store_tree
from tests.hostile_tars import GIB, HOSTILE, Hostile, files_tar, gnu_sparse_tar, many_members_tar
from tests.integration.helpers import bearer, make_worker_key

pytestmark = pytest.mark.integration


@pytest.fixture
def box(client: TestClient, store) -> dict[str, str]:
    """A remote machine with its key; a 6,000-step job running on it."""
    key = make_worker_key(store, "box-2")
    add_worker(store, "w@box-2", key)
    return {"key": key, "job": claimed_job(client, store, "w@box-2")}


def kept(settings: Settings, job_id: str) -> list[str]:
    """The job's store but the upload scratch directory (which keeps only its lock)."""
    incoming = settings.jobs_dir / job_id / ".incoming"
    assert not incoming.exists() or [p.name for p in incoming.iterdir()] in ([], [".lock"])
    return [p for p in store_tree(settings, job_id) if not p.startswith(".incoming")]


def record(store, job_id: str, step: int) -> None:
    with store.sessions() as session:
        session.add(Checkpoint(job_id=job_id, step=step, path="/on/box-2", bytes=1, final=False))
        session.commit()


def end(store, job_id: str, status: JobStatus) -> None:
    with store.sessions() as session:
        assert service.transition(session, job_id, status)
        session.commit()


class TestHostileTars:
    @pytest.mark.parametrize("hostile", HOSTILE, ids=lambda h: h.id)
    def test_every_hostile_tar_is_refused_by_the_one_reader_and_writes_nothing(
        self, client: TestClient, settings: Settings, box, hostile: Hostile
    ) -> None:
        response = put(client, box["job"], "adapter", hostile.build(), box["key"])
        code, status = ("too_large", 413) if hostile.too_large else ("unsafe_archive", 422)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["code"] == code and hostile.says in error["message"] and error["param"] == "body"
        assert kept(settings, box["job"]) == [] and not (settings.jobs_dir / "evil").exists()

    def test_a_10_kb_tar_with_a_gnu_sparse_member_of_3_gib_is_422_and_writes_nothing(
        self, client: TestClient, settings: Settings, box
    ) -> None:
        body = gnu_sparse_tar(3 * GIB)
        assert len(body) == 10240
        response = put(client, box["job"], "checkpoints/step-000002", body, box["key"])
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "unsafe_archive" and "sparse file" in error["message"] and error["param"] == "body"
        assert kept(settings, box["job"]) == []

    def test_a_tar_of_60000_members_is_413_naming_the_setting(self, client: TestClient, settings: Settings,
                                                               box) -> None:
        response = put(client, box["job"], "adapter", many_members_tar(60_000), box["key"])
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == "too_large" and "more than 10,000 members" in error["message"]
        assert "FTQ_WORKER_UPLOAD_MAX_MEMBERS" in error["message"]
        assert kept(settings, box["job"]) == []

    @pytest.mark.parametrize(("kind", "name", "linkname"), [
        (tarfile.SYMTYPE, "adapter_model.safetensors", "/etc/passwd"),
        (tarfile.LNKTYPE, "second", "first"),
        (tarfile.REGTYPE, "../../../escaped", ""),
    ])
    def test_a_link_or_an_escaping_member_is_422(self, client: TestClient, settings: Settings, box, kind: bytes,
                                                 name: str, linkname: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.addfile(tarfile.TarInfo("first"), io.BytesIO(b""))
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, linkname
            tar.addfile(info, io.BytesIO(b""))
        response = put(client, box["job"], "adapter", buf.getvalue(), box["key"])
        assert response.status_code == 422 and response.json()["error"]["code"] == "unsafe_archive", response.text
        assert kept(settings, box["job"]) == [] and not (settings.jobs_dir / "escaped").exists()


class TestCheckpoints:
    def test_step_999999_of_a_6000_step_job_is_422(self, client: TestClient, settings: Settings, box) -> None:
        response = put(client, box["job"], "checkpoints/step-999999", files_tar({"state.json": b"{}"}), box["key"])
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "path" and "past job" in error["message"] and "last step, 6000" in error["message"]
        assert kept(settings, box["job"]) == []

    def test_a_step_far_past_the_recorded_progress_waits_for_the_progress(
        self, client: TestClient, store, box
    ) -> None:
        job, body = box["job"], files_tar({"state.json": b"{}"})
        early = put(client, job, "checkpoints/step-005000", body, box["key"])
        assert early.status_code == 422 and "more than 1000 steps past" in early.json()["error"]["message"]
        with store.sessions() as session:
            session.get(Job, job).progress_step = 4500  # the worker's step events reached the store
            session.commit()
        assert put(client, job, "checkpoints/step-005000", body, box["key"]).status_code == 201

    def test_a_recorded_checkpoint_cannot_be_overwritten(self, client: TestClient, store, settings: Settings,
                                                         box) -> None:
        job = box["job"]
        assert put(client, job, "checkpoints/step-000002", files_tar({"w": b"good"}), box["key"]).status_code == 201
        again = put(client, job, "checkpoints/step-000002", files_tar({"w": b"unrecorded: replaced"}), box["key"])
        assert again.status_code == 201  # a retry before the worker recorded it
        record(store, job, 2)
        overwrite = put(client, job, "checkpoints/step-000002", files_tar({"w": b"evil"}), box["key"])
        assert overwrite.status_code == 409, overwrite.text
        assert "never replaced" in overwrite.json()["error"]["message"]
        assert (settings.jobs_dir / job / "checkpoints" / "step-000002" / "w").read_bytes() == b"unrecorded: replaced"


class TestQuota:
    def test_uploads_past_the_jobs_quota_are_413_and_leave_nothing(
        self, store, settings: Settings, admin_key: str
    ) -> None:
        small = settings.model_copy(update={"worker_upload_quota_gib": 16_000 / GIB, "worker_upload_max_members": 4})
        key = make_worker_key(store, "box-2")
        add_worker(store, "w@box-2", key)
        with TestClient(create_app(small), headers=bearer(admin_key)) as client:
            job = claimed_job(client, store, "w@box-2")
            six_kb = files_tar({"w.bin": b"\x01" * 6000})
            assert put(client, job, "checkpoints/step-000002", six_kb, key).status_code == 201
            assert put(client, job, "checkpoints/step-000004", six_kb, key).status_code == 201
            third = put(client, job, "checkpoints/step-000006", six_kb, key)
            assert third.status_code == 413, third.text
            assert "FTQ_WORKER_UPLOAD_QUOTA_GIB" in third.json()["error"]["message"]
            assert put(client, job, "checkpoints/step-000004", six_kb, key).status_code == 201  # a replacement fits
            huge = put(client, job, "adapter", b"\0" * 200_000, key)  # refused from its Content-Length
            assert huge.status_code == 413 and "do not fit" in huge.json()["error"]["message"]
        assert kept(small, job) == ["checkpoints", "checkpoints/step-000002", "checkpoints/step-000002/w.bin",
                                    "checkpoints/step-000004", "checkpoints/step-000004/w.bin"]


class TestExports:
    def test_an_export_upload_for_an_unknown_export_is_404(self, client: TestClient, store, settings: Settings,
                                                           box) -> None:
        unknown = put(client, box["job"], "exports/exp-0123abcd", files_tar({"m": b"m"}), box["key"])
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "path", unknown.text
        other_job = claimed_job(client, store, "w@box-2")
        with store.sessions() as session:
            assert service.transition(session, other_job, JobStatus.succeeded)
            export, _ = exports.create_export(session, other_job, "merged", None, owner_id=None, model_type=None)
            assert exports.claim(session, export.export_id, "w@box-2")
            session.commit()
        theirs = put(client, box["job"], f"exports/{export.export_id}", files_tar({"m": b"m"}), box["key"])
        assert theirs.status_code == 404, theirs.text
        assert kept(settings, box["job"]) == []


class TestLeftovers:
    def test_unrecorded_uploads_are_removed_after_the_job_ends(self, client: TestClient, store,
                                                               settings: Settings, box) -> None:
        job = box["job"]
        for path in ("checkpoints/step-000002", "checkpoints/step-000004", "adapter"):
            assert put(client, job, path, files_tar({"w": b"w"}), box["key"]).status_code == 201
        record(store, job, 2)
        for local in ("checkpoints/step-000006.tmp", "exports/exp-0a.tmp"):  # a local run's, being written
            (settings.jobs_dir / job / local).mkdir(parents=True)
        end(store, job, JobStatus.failed)
        assert UploadSweeper(store.sessions, settings).sweep_recent() == 2
        assert kept(settings, job) == ["checkpoints", "checkpoints/step-000002", "checkpoints/step-000002/w",
                                       "checkpoints/step-000006.tmp", "exports", "exports/exp-0a.tmp"]

    def test_the_api_start_removes_a_failed_exports_upload_and_keeps_a_succeeded_one(
        self, client: TestClient, store, settings: Settings, admin_key: str, box
    ) -> None:
        job = box["job"]
        assert put(client, job, "adapter", files_tar({"w": b"w"}), box["key"]).status_code == 201
        end(store, job, JobStatus.succeeded)
        ids = []
        for fmt in ("merged", "gguf"):
            with store.sessions() as session:
                export, _ = exports.create_export(session, job, fmt, None, owner_id=None, model_type=None)
                assert exports.claim(session, export.export_id, "w@box-2")
                session.commit()
                ids.append(export.export_id)
            assert put(client, job, f"exports/{export.export_id}", files_tar({"m": b"m"}), box["key"]).status_code == 201
        with store.sessions() as session:
            exports.finish(session, ids[0], path="/on/box-2", size=1)
            exports.finish(session, ids[1], path=None, size=None, error_code="export_error", message="x")
            session.commit()
        with TestClient(create_app(settings), headers=bearer(admin_key)):
            pass
        assert kept(settings, job) == ["adapter", "adapter/w", "exports", f"exports/{ids[0]}", f"exports/{ids[0]}/m"]


class TestDownloads:
    @pytest.mark.parametrize(("headers", "status"), [({}, 200), ({"Range": "bytes=999999999-"}, 416),
                                                     ({"Range": "bytes=x-y"}, 400)],
                             ids=["whole", "unsatisfiable-range", "malformed-range"])
    def test_no_temporary_archive_is_left_after_a_download(self, client: TestClient, store, settings: Settings,
                                                           box, headers: dict[str, str], status: int) -> None:
        job, tmp = box["job"], settings.data_dir / "tmp"
        assert put(client, job, "checkpoints/step-000002", files_tar({"w": b"w" * 100}), box["key"]).status_code == 201
        record(store, job, 2)
        artifact = client.get(f"/v1/worker/jobs/{job}/artifacts/checkpoints/step-000002",
                              headers={**bearer(box["key"]), **headers})
        assert artifact.status_code == status and list(tmp.iterdir()) == [], artifact.text
        end(store, job, JobStatus.succeeded)
        with store.sessions() as session:
            export, _ = exports.create_export(session, job, "merged", None, owner_id=None, model_type=None)
            assert exports.claim(session, export.export_id, "w@box-2")
            session.commit()
        assert put(client, job, f"exports/{export.export_id}", files_tar({"m": b"m"}), box["key"]).status_code == 201
        with store.sessions() as session:
            exports.finish(session, export.export_id, path="/on/box-2", size=1)
            session.commit()
        for url in (f"/v1/jobs/{job}/checkpoints/2/download", f"/v1/jobs/{job}/checkpoints/2/download?format=tar.gz",
                    f"/v1/jobs/{job}/exports/{export.export_id}/download"):
            response = client.get(url, headers=headers)
            assert response.status_code == status and list(tmp.iterdir()) == [], (url, response.text)
        if status == 200:
            assert zipfile.ZipFile(io.BytesIO(response.content)).namelist() == ["m"]
            assert artifact.headers["X-Ftq-Sha256"] == sha(artifact.content)
