"""POST/GET /v1/jobs, cancel, metrics, checkpoints, adapter, against both stores."""

from __future__ import annotations

import csv
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.jobs import service
from core.jobs.models import Checkpoint, Job, JobEvent, StepMetric
from core.jobs.states import JobStatus
from core.queue import TASK_RUN_JOB
from core.settings import Settings
from tests.fixtures.broker import sent_tasks
from tests.integration.fake_hub import FakeHub
from tests.integration.helpers import bearer, spec, upload
from trainer.events import STEP_FIELDS, make_event
from worker.recorder import apply_events

pytestmark = pytest.mark.integration


def count(store, model) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


class TestCreate:
    def test_created_job_is_queued_with_state_event_and_enqueued(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        file_id = upload(client)
        response = client.post("/v1/jobs", json=spec(file_id, name="first"))
        assert response.status_code == 201, response.text
        job = response.json()
        assert job["status"] == "queued"
        assert job["name"] == "first"
        assert job["progress"] == {"step": 0, "total_steps": 3}
        assert job["error"] is None
        assert job["spec"]["lora"] == {"r": 16, "alpha": 16, "dropout": 0.0, "target_modules": ["all-linear"]}
        assert job["spec"]["optimizations"]["packed_metadata_cache"] == "auto"
        with store.sessions() as session:
            events = service.events_after(session, job["id"], 0)
        assert [(e.seq, e.type, e.data["status"]) for e in events] == [(1, "state", "queued")]
        assert sent_tasks(settings, client) == [(TASK_RUN_JOB, [job["id"]])]
        assert client.get(f"/v1/jobs/{job['id']}").json() == job

    def test_epochs_default_to_one_when_no_length_is_given(self, client: TestClient, store) -> None:
        file_id = upload(client)
        response = client.post("/v1/jobs", json={"model": "tiny", "training_file": file_id})
        assert response.status_code == 201, response.text
        assert response.json()["spec"]["hyperparameters"]["epochs"] == 1.0
        assert response.json()["progress"]["total_steps"] is None

    @pytest.mark.parametrize(
        ("change", "param", "fragment"),
        [
            ({"colour": "blue"}, "colour", "unknown field"),
            (
                {"hyperparameters": {"max_steps": 3, "learning_rat": 0.1}},
                "hyperparameters.learning_rat",
                "learning_rate",
            ),
            ({"hyperparameters": {"learning_rate": -1}}, "hyperparameters.learning_rate", "greater than 0"),
            ({"hyperparameters": {"max_steps": 0}}, "hyperparameters.max_steps", "greater than or equal to 1"),
            ({"hyperparameters": {"max_steps": 5, "epochs": 1}}, "hyperparameters.epochs", "not both"),
            ({"hyperparameters": {"batch_tokens": 1024, "max_seq_len": 2048}}, "hyperparameters.batch_tokens", "raise batch_tokens"),
            ({"hyperparameters": {"max_steps": 5, "warmup_steps": 5}}, "hyperparameters.warmup_steps", "must be < max_steps"),
            ({"lora": {"r": 0}}, "lora.r", "greater than or equal to 1"),
            ({"lora": {"dropout": 1.0}}, "lora.dropout", "less than 1"),
            ({"lora": {"target_modules": ["all-linear", "q_proj"]}}, "lora.target_modules", "alone"),
            ({"method": "dpo"}, "method", "'lora', 'qlora' or 'full'"),
            (
                {"optimizations": {"moe_grouped_routing": "yes"}},
                "optimizations.moe_grouped_routing",
                "'auto', 'on' or 'off'",
            ),
            ({"checkpoint_every": -1}, "checkpoint_every", "greater than or equal to 0"),
            ({"training_file": "data.jsonl"}, "training_file", "POST /v1/files"),
            ({"model": 5}, "model", "valid string"),
        ],
    )
    def test_bad_spec_is_422_naming_the_field_and_stores_nothing(
        self, client: TestClient, store, settings: Settings, change: dict, param: str, fragment: str
    ) -> None:
        file_id = upload(client)
        body = spec(file_id)
        body.update(change)
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert fragment in error["message"], error["message"]
        assert count(store, Job) == 0
        assert sent_tasks(settings, client) == []

    def test_missing_model_field_says_required(self, client: TestClient, store) -> None:
        response = client.post("/v1/jobs", json={"training_file": upload(client)})
        assert response.status_code == 422
        assert response.json()["error"]["message"] == "model: required; add it"

    def test_body_that_is_not_json_is_422(self, client: TestClient, store) -> None:
        response = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 422
        assert "not valid JSON" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] is None  # not the character offset pydantic puts in loc

    @pytest.mark.parametrize(
        ("model", "fragment"),
        [
            ("../etc", "'..' is not allowed"),
            ("tiny/../../x", "'..' is not allowed"),
            ("/etc", "outside the model root"),
            ("missing", "not a hub id"),
            ("nested/none", None),
        ],
    )
    def test_model_outside_root_or_missing_is_422(
        self,
        client: TestClient,
        store,
        model_root: Path,
        monkeypatch: pytest.MonkeyPatch,
        model: str,
        fragment: str | None,
    ) -> None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HUB_CACHE", str(model_root.parent / "hf-cache"))
        response = client.post("/v1/jobs", json=spec(upload(client), model=model))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "model"
        assert (fragment or "HF_HUB_OFFLINE=1") in error["message"]
        assert count(store, Job) == 0

    def test_model_dir_without_config_json_is_422(self, client: TestClient, store, model_root: Path) -> None:
        (model_root / "empty").mkdir()
        response = client.post("/v1/jobs", json=spec(upload(client), model="empty"))
        assert response.status_code == 422
        assert "no config.json" in response.json()["error"]["message"]

    def test_absolute_path_inside_root_and_hub_id_online_are_accepted(
        self, client: TestClient, store, model_root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_CACHE", str(model_root.parent / "hf-cache"))
        file_id = upload(client)
        assert client.post("/v1/jobs", json=spec(file_id, model=str(model_root / "tiny"))).status_code == 201
        with FakeHub({"Qwen/Qwen3-0.6B"}) as hub:  # the hub answers that it has the model
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            assert client.post("/v1/jobs", json=spec(file_id, model="Qwen/Qwen3-0.6B")).status_code == 201

    def test_unknown_deleted_or_wrong_purpose_files_are_422(self, client: TestClient, store) -> None:
        missing = "file-" + "0" * 24
        response = client.post("/v1/jobs", json=spec(missing))
        assert response.status_code == 422
        assert response.json()["error"] == {
            "code": "invalid_input",
            "message": f"training_file: no file '{missing}'; upload it with POST /v1/files "
            "(purpose=train) and use its id",
            "param": "training_file",
        }
        validation = upload(client, purpose="validation")
        response = client.post("/v1/jobs", json=spec(validation))
        assert response.status_code == 422
        assert "purpose=validation" in response.json()["error"]["message"]
        train = upload(client)
        # other bytes than ``train``'s: the same bytes would be the same (deduplicated) file
        other = {"messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "hi there"}]}
        response = client.post("/v1/jobs", json=spec(train, validation_file=upload(client, record=other)))
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "validation_file"
        client.delete(f"/v1/files/{train}")
        assert client.post("/v1/jobs", json=spec(train)).status_code == 422
        assert count(store, Job) == 0

    def test_qlora_without_a_live_worker_is_refused_with_the_fix(self, client: TestClient, store) -> None:
        # Workers that report CUDA + bitsandbytes: tests/integration/test_api_jobs_plan.py.
        response = client.post("/v1/jobs", json=spec(upload(client), method="qlora"))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported", "method")
        assert "needs a worker with a CUDA GPU and bitsandbytes; no worker is live" in error["message"]
        assert "Use method lora, or install bitsandbytes on a GPU worker (pip install 'ftq[qlora]')" in error["message"]
        assert count(store, Job) == 0

    def test_full_is_accepted_but_not_with_lora_settings(self, client: TestClient, store) -> None:
        file_id = upload(client)
        assert client.post("/v1/jobs", json=spec(file_id, method="full")).status_code == 201
        response = client.post("/v1/jobs", json=spec(file_id, method="full", lora={"r": 8}))
        assert response.status_code == 422
        assert "remove 'lora'" in response.json()["error"]["message"]


class TestIdempotency:
    def test_same_key_same_body_returns_the_same_job(self, client: TestClient, store, settings: Settings) -> None:
        body = spec(upload(client))
        first = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k1"})
        second = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k1"})
        assert first.status_code == 201
        assert second.status_code == 200
        assert second.headers["Idempotent-Replayed"] == "true"
        assert second.json()["id"] == first.json()["id"]
        assert count(store, Job) == 1
        assert count(store, JobEvent) == 1

    def test_same_key_different_body_is_409(self, client: TestClient, store) -> None:
        body = spec(upload(client))
        assert client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k2"}).status_code == 201
        body["hyperparameters"] = {"max_steps": 4}
        response = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k2"})
        assert response.status_code == 409
        assert "different body" in response.json()["error"]["message"]
        assert count(store, Job) == 1

    def test_different_keys_make_different_jobs(self, client: TestClient, store) -> None:
        body = spec(upload(client))
        a = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "a"}).json()["id"]
        b = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "b"}).json()["id"]
        assert a != b


class TestListAndCancel:
    def test_status_filter_and_cursor_paging_newest_first(self, client: TestClient, store) -> None:
        file_id = upload(client)
        ids = [client.post("/v1/jobs", json=spec(file_id)).json()["id"] for _ in range(5)]
        client.post(f"/v1/jobs/{ids[1]}/cancel")
        seen, cursor = [], None
        while True:
            params = {"limit": 2, **({"after": cursor} if cursor else {})}
            page = client.get("/v1/jobs", params=params).json()
            seen += [j["id"] for j in page["data"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids[::-1]
        queued = client.get("/v1/jobs", params={"status": "queued"}).json()["data"]
        assert [j["id"] for j in queued] == [ids[4], ids[3], ids[2], ids[0]]
        both = client.get("/v1/jobs", params={"status": "queued,cancelled", "limit": 10}).json()["data"]
        assert len(both) == 5
        bad = client.get("/v1/jobs", params={"status": "done"})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "status"
        bad = client.get("/v1/jobs", params={"after": "garbage!"})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "after"
        assert client.get("/v1/jobs", params={"limit": 0}).status_code == 422

    def test_cancel_queued_is_immediate_and_final(self, client: TestClient, store) -> None:
        job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
        response = client.post(f"/v1/jobs/{job_id}/cancel")
        assert response.status_code == 200
        assert response.json()["status"] == "cancelled"
        assert response.json()["finished_at"] is not None
        with store.sessions() as session:
            types = [(e.type, e.data["status"]) for e in service.events_after(session, job_id, 0)]
            assert types == [("state", "queued"), ("state", "cancelled")]
            # the worker's claim (a CAS from queued) can no longer win
            assert not service.transition(session, job_id, JobStatus.running, only_from=[JobStatus.queued])
        again = client.post(f"/v1/jobs/{job_id}/cancel")
        assert again.status_code == 409
        assert "already cancelled" in again.json()["error"]["message"]

    def test_cancel_running_sets_the_flag_and_answers_202(self, client: TestClient, store) -> None:
        job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
        with store.sessions() as session:
            assert service.transition(session, job_id, JobStatus.running, only_from=[JobStatus.queued])
            session.commit()
        response = client.post(f"/v1/jobs/{job_id}/cancel")
        assert response.status_code == 202
        assert response.json()["status"] == "running"
        assert response.json()["cancel_requested"] is True
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202

    def test_file_in_use_cannot_be_deleted_until_the_job_ends(self, client: TestClient, store) -> None:
        file_id = upload(client)
        job_id = client.post("/v1/jobs", json=spec(file_id)).json()["id"]
        response = client.delete(f"/v1/files/{file_id}")
        assert response.status_code == 409
        assert job_id and "queued or running job" in response.json()["error"]["message"]
        client.post(f"/v1/jobs/{job_id}/cancel")
        assert client.delete(f"/v1/files/{file_id}").status_code == 200
        assert client.get(f"/v1/jobs/{job_id}").json()["training_file"] == file_id

    def test_unknown_job_is_404(self, client: TestClient, store) -> None:
        for path in ("", "/metrics", "/events", "/checkpoints", "/adapter"):
            assert client.get(f"/v1/jobs/job-nope{path}").status_code == 404
        assert client.post("/v1/jobs/job-nope/cancel").status_code == 404


class TestMetricsAndArtifacts:
    def _job(self, client: TestClient) -> str:
        return client.post("/v1/jobs", json=spec(upload(client))).json()["id"]

    def test_metrics_page_by_after_step(self, client: TestClient, store) -> None:
        job_id = self._job(client)
        with store.sessions() as session:
            session.add_all(
                StepMetric(job_id=job_id, step=s, loss=10.0 - s, lr=1e-4, tokens=100 * s, step_ms=5.0)
                for s in range(1, 8)
            )
            session.commit()
        first = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 3}).json()
        assert [m["step"] for m in first["data"]] == [1, 2, 3]
        assert first["next_after_step"] == 3
        assert first["data"][0]["loss"] == 9.0 and first["data"][0]["mfu"] is None
        assert set(first["data"][0]) >= {"step", "loss", "lr", "grad_norm", "tokens", "sequences", "step_ms",
                                           "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "tokens_per_s",
                                           "mfu", "gpu_mem_allocated", "gpu_mem_reserved", "gpu_mem_peak",
                                           "host_rss", "time"}
        rest = client.get(f"/v1/jobs/{job_id}/metrics", params={"after_step": 3, "limit": 10}).json()
        assert [m["step"] for m in rest["data"]] == [4, 5, 6, 7]
        assert rest["next_after_step"] is None

    def test_allocator_retries_go_from_the_step_event_to_metrics_ranks_and_csv(self, client: TestClient, store) -> None:
        job_id = self._job(client)
        ranks = [{"rank": r, "step_ms": 4.0, "data_ms": 0.5, "forward_ms": 1.0, "backward_ms": 2.0, "optimizer_ms": 0.5,
                  "tokens": 50, "gpu_mem_allocated": 1, "gpu_mem_reserved": 2, "gpu_mem_peak": 3,
                  "gpu_alloc_retries": 3 * r, "host_rss": 4} for r in range(2)]
        events = [make_event("step", **{**dict.fromkeys(STEP_FIELDS), "step": step, "total_steps": 3, "loss": 1.0,
                                         "gpu_alloc_retries": retries, "ranks": ranks if step == 3 else None})
                  for step, retries in ((1, None), (2, 0), (3, 3))]  # CPU-like, a calm step, a stall summed over ranks
        with store.sessions() as session:
            apply_events(session, job_id, events)
            session.commit()
        data = client.get(f"/v1/jobs/{job_id}/metrics").json()["data"]
        assert [m["gpu_alloc_retries"] for m in data] == [None, 0, 3]
        assert [r["gpu_alloc_retries"] for r in data[2]["ranks"]] == [0, 3]
        rows = list(csv.DictReader(io.StringIO(client.get(f"/v1/jobs/{job_id}/metrics.csv").text)))
        assert [r["gpu_alloc_retries"] for r in rows] == ["", "0", "3"]
        described = client.get("/openapi.json").json()["components"]["schemas"]["MetricOut"]["properties"]
        assert "caching allocator" in described["gpu_alloc_retries"]["description"]

    def test_adapter_is_409_until_succeeded_then_downloads_as_zip_or_tar(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        job_id = self._job(client)
        assert client.get(f"/v1/jobs/{job_id}/adapter").status_code == 409
        adapter = settings.jobs_dir / job_id / "adapter"
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text('{"r": 16}')
        (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
        with store.sessions() as session:
            assert service.transition(session, job_id, JobStatus.running)
            assert service.transition(session, job_id, JobStatus.succeeded)
            session.commit()
        response = client.get(f"/v1/jobs/{job_id}/adapter")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/zip"
        assert f"{job_id}-adapter.zip" in response.headers["content-disposition"]
        # Self-describing (api/jobs/card.py): the base named as under the model root, a model card.
        with zipfile.ZipFile(io.BytesIO(response.content)) as zf:
            # the model root's tiny model has a tokenizer: the adapter carries it (and its chat template)
            assert sorted(zf.namelist()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                             "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
            assert json.loads(zf.read("adapter_config.json")) == {"r": 16, "base_model_name_or_path": "tiny"}
            card = zf.read("README.md").decode()
            assert card.startswith("---\nbase_model: tiny\n") and "sha256" in card
        response = client.get(f"/v1/jobs/{job_id}/adapter", params={"format": "tar.gz"})
        with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tf:
            assert sorted(tf.getnames()) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                             "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
        assert list((settings.data_dir / "tmp").iterdir()) == []

    def test_checkpoints_list_and_download(
        self, client: TestClient, store, settings: Settings, tmp_path: Path
    ) -> None:
        job_id = self._job(client)
        ckpt = settings.jobs_dir / job_id / "checkpoints" / "step-000002"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text('{"step": 2}')
        (ckpt / "elsewhere").symlink_to(tmp_path)  # links are never followed into the archive
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "secret.txt").write_text("not the job's")
        with store.sessions() as session:
            session.add(Checkpoint(job_id=job_id, step=2, path=str(ckpt), bytes=11, final=False))
            # a row whose path (reported by a worker) lies outside the job's directory: the API reads
            # the job's artifact store (<jobs_dir>/<job_id>/checkpoints/step-000003), never that path
            session.add(Checkpoint(job_id=job_id, step=3, path=str(outside), bytes=1, final=False))
            session.commit()
        listed = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
        assert [(c["step"], c["bytes"], c["final"]) for c in listed] == [(2, 11, False), (3, 1, False)]
        response = client.get(f"/v1/jobs/{job_id}/checkpoints/2/download")
        with zipfile.ZipFile(io.BytesIO(response.content)) as zf:
            assert zf.namelist() == ["state.json"]
            assert zf.read("state.json") == b'{"step": 2}'
        refused = client.get(f"/v1/jobs/{job_id}/checkpoints/3/download")
        assert refused.status_code == 404 and "no longer on disk" in refused.json()["error"]["message"]
        missing = client.get(f"/v1/jobs/{job_id}/checkpoints/9/download")
        assert missing.status_code == 404 and "no checkpoint at step 9" in missing.json()["error"]["message"]


def test_broker_down_after_commit_still_creates_the_queued_job(
    store, settings: Settings, admin_key: str, caplog
) -> None:
    from api.app import create_app

    dead = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(dead), headers=bearer(admin_key)) as c:
        file_id = upload(c)
        response = c.post("/v1/jobs", json=spec(file_id))
    assert response.status_code == 201, response.text
    assert response.json()["status"] == "queued"
    assert count(store, Job) == 1
    assert "not signalled to the workers" in caplog.text
