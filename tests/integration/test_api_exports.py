"""/v1/jobs/{id}/exports against both stores: validation, de-duplication, the message, download.

The export itself (a worker running ``python -m trainer export``) is proven end to end in
tests/integration/e2e/test_jobs_e2e.py; here the worker's side is played through
``core.exports.service`` (claim, progress, finish) as worker/exports.py calls it.
"""

from __future__ import annotations

import io
import json
import zipfile

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from core.exports import service as exports
from core.jobs import service
from core.jobs.models import Job
from core.jobs.states import JobStatus
from core.queue import TASK_EXPORT
from core.settings import Settings
from tests.fixtures.broker import sent_tasks
from tests.integration.helpers import spec, upload

pytestmark = pytest.mark.integration


def _succeeded_job(client: TestClient, store, settings: Settings) -> str:
    job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
    with store.sessions() as session:
        assert service.transition(session, job_id, JobStatus.running, output_dir=str(settings.jobs_dir / job_id))
        assert service.transition(session, job_id, JobStatus.succeeded)
        session.commit()
    sent_tasks(settings, client)  # the job's own jobs.run message
    return job_id


class TestCreate:
    def test_an_export_of_an_unfinished_job_is_409(self, client: TestClient, settings: Settings) -> None:
        job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
        response = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "merged"})
        assert response.status_code == 409
        assert "queued; it can be exported once it has succeeded" in response.json()["error"]["message"]

    def test_bad_requests_are_422_naming_the_field(self, client: TestClient, store, settings: Settings) -> None:
        job_id = _succeeded_job(client, store, settings)
        for body, param, message in [
            ({"format": "onnx"}, "format", "'merged' or 'gguf'"),
            ({"format": "gguf", "quantization": "q4_k"}, "quantization", "'f32', 'f16', 'bf16' or 'q8_0'"),
            ({"format": "merged", "quantization": "q8_0"}, "quantization", "only format gguf has one"),
            ({"format": "merged", "dtype": "bf16"}, "dtype", "unknown field, remove it or fix its spelling"),
        ]:
            response = client.post(f"/v1/jobs/{job_id}/exports", json=body)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert param in (error.get("param") or "") and message in error["message"], error

    def test_gguf_of_an_architecture_the_writer_lacks_is_422(self, client: TestClient, store, settings: Settings) -> None:
        job_id = _succeeded_job(client, store, settings)
        base = settings.model_root / "moe"
        base.mkdir()
        (base / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
        job_dir = settings.jobs_dir / job_id
        job_dir.mkdir(parents=True)
        # what a worker reported is not read: the base is resolved from the job's own model
        (job_dir / "job.json").write_text(json.dumps({"model": {"name_or_path": str(settings.model_root / "tiny")}}))
        with store.sessions() as session:
            session.execute(update(Job).where(Job.job_id == job_id).values(model="moe"))
            session.commit()
        response = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "gguf"})
        assert response.status_code == 422
        assert "this job's base is 'gpt_oss' (format merged works for every model)" in response.json()["error"]["message"]

    def test_created_once_per_kind_while_active_and_sent_to_the_worker(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        job_id = _succeeded_job(client, store, settings)
        first = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "gguf"})
        assert first.status_code == 202, first.text
        export = first.json()
        assert (export["status"], export["quantization"], export["download_url"]) == ("queued", "f16", None)
        again = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "gguf", "quantization": "f16"})
        assert again.status_code == 200 and again.json()["id"] == export["id"]
        other = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "gguf", "quantization": "q8_0"})
        assert other.status_code == 202 and other.json()["id"] != export["id"]
        assert sent_tasks(settings) == [(TASK_EXPORT, [export["id"]])] * 2 + [(TASK_EXPORT, [other.json()["id"]])]
        listed = client.get(f"/v1/jobs/{job_id}/exports").json()["data"]
        assert [e["id"] for e in listed] == [export["id"], other.json()["id"]]


class TestProgressAndDownload:
    def test_progress_then_download_of_a_merged_export(self, client: TestClient, store, settings: Settings) -> None:
        job_id = _succeeded_job(client, store, settings)
        export_id = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "merged"}).json()["id"]
        url = f"/v1/jobs/{job_id}/exports/{export_id}"
        assert client.get(url + "/download").status_code == 409
        with store.sessions() as session:
            assert exports.claim(session, export_id, "host-a") is not None
            assert exports.claim(session, export_id, "host-b") is None, "a redelivered task must not run it twice"
            exports.record_progress(session, export_id, "save", 0.5)
            session.commit()
        assert client.get(url).json()["progress"] == pytest.approx(0.8)  # load + merge done, save half
        out = settings.jobs_dir / job_id / "exports" / export_id
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 16)
        with store.sessions() as session:
            exports.finish(session, export_id, path=str(out), size=18)
            session.commit()
        export = client.get(url).json()
        assert (export["status"], export["progress"], export["download_url"]) == ("succeeded", 1.0, url + "/download")
        response = client.get(export["download_url"])
        assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
        assert sorted(zipfile.ZipFile(io.BytesIO(response.content)).namelist()) == ["config.json", "model.safetensors"]
        with store.sessions() as session:
            kinds = [(e.type, e.data["status"]) for e in service.events_after(session, job_id, 0) if e.type == "export"]
        assert kinds == [("export", "queued"), ("export", "running"), ("export", "running"), ("export", "succeeded")]

    def test_a_gguf_export_downloads_as_the_file(self, client: TestClient, store, settings: Settings) -> None:
        job_id = _succeeded_job(client, store, settings)
        export_id = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "gguf", "quantization": "q8_0"}).json()["id"]
        out = settings.jobs_dir / job_id / "exports" / export_id
        out.mkdir(parents=True)
        (out / "model-q8_0.gguf").write_bytes(b"GGUF" + b"\0" * 8)
        with store.sessions() as session:
            exports.claim(session, export_id, "host-a")
            exports.finish(session, export_id, path=str(out), size=12)
            session.commit()
        response = client.get(f"/v1/jobs/{job_id}/exports/{export_id}/download")
        assert response.status_code == 200 and response.content.startswith(b"GGUF")
        assert f"{job_id}-gguf-q8_0.gguf" in response.headers["content-disposition"]

    def test_a_failed_export_says_why_and_has_no_download(self, client: TestClient, store, settings: Settings) -> None:
        job_id = _succeeded_job(client, store, settings)
        export_id = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "merged"}).json()["id"]
        with store.sessions() as session:
            exports.claim(session, export_id, "host-a")
            exports.finish(session, export_id, path=None, size=None, error_code="out_of_memory", message="no room")
            session.commit()
        export = client.get(f"/v1/jobs/{job_id}/exports/{export_id}").json()
        assert (export["status"], export["error_code"], export["download_url"]) == ("failed", "out_of_memory", None)
        response = client.get(f"/v1/jobs/{job_id}/exports/{export_id}/download")
        assert response.status_code == 409 and "is failed" in response.json()["error"]["message"]
        assert client.get(f"/v1/jobs/{job_id}/exports/exp-nope").status_code == 404
