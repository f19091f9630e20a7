"""Clone with overrides, resume from a checkpoint, metrics as CSV, search, the folded error: both stores.

Clone, resume and the OpenAI create are submissions like ``POST /v1/jobs`` (one path,
``core.jobs.submit``): issue 23 found a clone accepted where a new job with the same spec was
refused by the dataset preflight."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.jobs import service
from core.jobs.models import Checkpoint, Job, JobEvent, StepMetric
from core.jobs.states import JobStatus
from core.openai.models import OpenAIJob
from tests.integration.helpers import bearer, finish, make_user, spec, upload
from trainer.training import layout

pytestmark = pytest.mark.integration


def submitted(client: TestClient, **overrides) -> dict:
    response = client.post("/v1/jobs", json=spec(upload(client), **overrides))
    assert response.status_code == 201, response.text
    return response.json()


def with_checkpoints(store, job_id: str, steps: list[int]) -> Path:
    """Checkpoint directories (with the trainer's state file) under the job's directory, recorded."""
    with store.sessions() as session:
        output_dir = Path(session.get(Job, job_id).output_dir)
        for step in steps:
            ckpt = layout.checkpoint_dir(output_dir, step)
            ckpt.mkdir(parents=True)
            (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
            session.add(Checkpoint(job_id=job_id, step=step, path=str(ckpt), bytes=12, final=False))
        session.commit()
    return output_dir


class TestClone:
    def test_overrides_merge_into_the_source_spec_and_make_a_new_queued_job(self, client) -> None:
        source = submitted(client, name="base", hyperparameters={"max_steps": 3, "learning_rate": 1e-3})
        response = client.post(f"/v1/jobs/{source['id']}/clone",
                               json={"name": "lower lr", "hyperparameters": {"learning_rate": 1e-4}})
        assert response.status_code == 201, response.text
        clone = response.json()
        assert clone["id"] != source["id"] and clone["status"] == "queued" and clone["name"] == "lower lr"
        hp = clone["spec"]["hyperparameters"]
        assert hp["learning_rate"] == 1e-4 and hp["max_steps"] == 3
        assert clone["training_file"] == source["training_file"]
        assert client.get(f"/v1/jobs/{source['id']}").json()["spec"]["hyperparameters"]["learning_rate"] == 1e-3

    def test_epochs_replace_the_sources_max_steps(self, client) -> None:
        source = submitted(client)
        clone = client.post(f"/v1/jobs/{source['id']}/clone", json={"hyperparameters": {"epochs": 2}}).json()
        assert clone["spec"]["hyperparameters"]["epochs"] == 2 and clone["spec"]["hyperparameters"]["max_steps"] is None

    def test_a_bad_override_names_its_field(self, client) -> None:
        source = submitted(client)
        response = client.post(f"/v1/jobs/{source['id']}/clone", json={"hyperparameters": {"learning_rate": 5}})
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "hyperparameters.learning_rate"
        unknown = client.post(f"/v1/jobs/{source['id']}/clone", json={"hyperparams": {}})
        assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "hyperparams"

    def test_cloning_another_users_job_needs_their_files(self, client, store) -> None:
        source = submitted(client)
        alice = make_user(store, "alice")
        response = client.post(f"/v1/jobs/{source['id']}/clone", json={}, headers=bearer(alice))
        assert response.status_code == 403 and response.json()["error"]["param"] == "training_file"


class TestResume:
    def test_resumes_a_cancelled_job_from_the_chosen_checkpoint_as_a_new_job(self, client, store) -> None:
        source = submitted(client)
        with_checkpoints(store, source["id"], [1, 2])
        finish(store, source["id"], JobStatus.cancelled)
        response = client.post(f"/v1/jobs/{source['id']}/resume", json={"step": 1})
        assert response.status_code == 201, response.text
        job = response.json()
        assert job["status"] == "queued" and job["spec"] == source["spec"]
        steps = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert [c["step"] for c in steps] == [1]
        with store.sessions() as session:
            seeded = layout.checkpoint_dir(session.get(Job, job["id"]).output_dir, 1)
        assert (seeded / "trainer_state.json").read_text() == '{"step": 1}'
        assert client.get(f"/v1/jobs/{source['id']}/checkpoints").json()["data"][1]["step"] == 2  # source kept

    def test_default_is_the_newest_checkpoint(self, client, store) -> None:
        source = submitted(client)
        with_checkpoints(store, source["id"], [1, 2])
        finish(store, source["id"], JobStatus.failed)
        job = client.post(f"/v1/jobs/{source['id']}/resume").json()
        assert [c["step"] for c in client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]] == [2]

    def test_refusals_say_what_would_work(self, client, store) -> None:
        source = submitted(client)
        running = client.post(f"/v1/jobs/{source['id']}/resume")
        assert running.status_code == 409 and "clone" in running.json()["error"]["message"]
        with_checkpoints(store, source["id"], [2])
        finish(store, source["id"], JobStatus.failed)
        missing = client.post(f"/v1/jobs/{source['id']}/resume", json={"step": 7})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "step"
        assert "at step 2" in missing.json()["error"]["message"]
        bare = submitted(client)
        finish(store, bare["id"], JobStatus.failed)
        assert client.post(f"/v1/jobs/{bare['id']}/resume").status_code == 409


def upload_records(client: TestClient, records: list[dict]) -> str:
    content = "".join(json.dumps(r) + "\n" for r in records)
    response = client.post("/v1/files", files={"file": ("d.jsonl", content)}, data={"purpose": "train"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def stored(store, settings) -> dict:
    """What a refused submission must leave as it was: every row it could add, and the job directories."""
    with store.sessions() as session:
        counts = {model.__tablename__: session.scalar(select(func.count()).select_from(model))
                  for model in (Job, JobEvent, Checkpoint, OpenAIJob)}
    jobs_dir = settings.data_dir / "jobs"
    return {**counts, "dirs": sorted(p.name for p in jobs_dir.iterdir()) if jobs_dir.is_dir() else []}


def drop_assistant_turns(model_root: Path) -> None:
    """The tiny model's chat template from now on renders no assistant turn: nothing to train on."""
    tiny = model_root / "tiny"
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tiny / "tokenizer_config.json").write_text(json.dumps(config))
    (tiny / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}\n{% endif %}{% endfor %}")


class TestRerunsAreSubmissions:
    """Each refusal is compared with the answer ``POST /v1/jobs`` gives the same spec."""

    def test_a_clone_runs_the_dataset_preflight_and_stores_its_report(self, client) -> None:
        source = submitted(client, hyperparameters={"max_steps": 10_000_000})
        clone = client.post(f"/v1/jobs/{source['id']}/clone", json={"name": "again"})
        assert clone.status_code == 201, clone.text
        report = clone.json()["preflight"]
        assert report["checked"] and report["records"] == 1 and report["tokens"] > 0
        assert report["warnings"] == source["preflight"]["warnings"]
        assert any(w.startswith("max_steps 10000000 repeats") for w in report["warnings"])

    def test_data_the_model_can_no_longer_train_refuses_clone_and_resume_as_a_new_job(
        self, client, store, settings, model_root: Path
    ) -> None:
        source = submitted(client)
        with_checkpoints(store, source["id"], [1])
        finish(store, source["id"], JobStatus.cancelled)
        drop_assistant_turns(model_root)
        before = stored(store, settings)
        new = client.post("/v1/jobs", json=source["spec"])
        assert new.status_code == 422, new.text
        assert new.json()["error"]["param"] == "training_file"
        assert "chat template puts no assistant tokens" in new.json()["error"]["message"]
        for route in ("clone", "resume"):
            refused = client.post(f"/v1/jobs/{source['id']}/{route}")
            assert (refused.status_code, refused.json()) == (422, new.json()), route
        assert stored(store, settings) == before

    def test_a_clone_override_that_breaks_a_rule_is_refused_as_a_new_job(self, client, store, settings) -> None:
        records = [{"prompt": "the cat sat on the mat " * 10, "completion": "yes"} for _ in range(3)]
        source = client.post("/v1/jobs", json=spec(upload_records(client, records))).json()
        before = stored(store, settings)
        cut = {"hyperparameters": {"max_seq_len": 16, "batch_tokens": 64}}
        body = {**source["spec"], "hyperparameters": {**source["spec"]["hyperparameters"], **cut["hyperparameters"]}}
        new = client.post("/v1/jobs", json=body)
        assert new.status_code == 422 and new.json()["error"]["param"] == "hyperparameters.max_seq_len", new.text
        refused = client.post(f"/v1/jobs/{source['id']}/clone", json=cut)
        assert (refused.status_code, refused.json()) == (422, new.json())
        qlora = client.post(f"/v1/jobs/{source['id']}/clone", json={"method": "qlora"})  # no live GPU worker
        new = client.post("/v1/jobs", json={**source["spec"], "method": "qlora"})
        assert (qlora.status_code, qlora.json()) == (422, new.json())
        assert qlora.json()["error"]["param"] == "method", qlora.text
        assert stored(store, settings) == before

    def test_the_openai_create_runs_the_same_preflight(self, client, store, settings, model_root: Path) -> None:
        file_id = upload_records(client, [{"messages": [{"role": "user", "content": "the cat"},
                                                        {"role": "assistant", "content": "sat on a mat"}]}] * 10)
        drop_assistant_turns(model_root)
        before = stored(store, settings)
        native = client.post("/v1/jobs", json=spec(file_id))
        refused = client.post("/openai/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "training_file"
        assert refused.json()["error"]["message"] == native.json()["error"]["message"]
        assert stored(store, settings) == before


class TestMetricsCsvAndSearch:
    def test_metrics_download_as_csv_with_a_row_per_step(self, client, store) -> None:
        job = submitted(client)
        with store.sessions() as session:
            for step, loss in ((1, 2.5), (2, 2.25)):
                session.add(StepMetric(job_id=job["id"], step=step, loss=loss, lr=1e-4, tokens=100))
            session.commit()
        response = client.get(f"/v1/jobs/{job['id']}/metrics.csv")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/csv")
        assert f'{job["id"]}-metrics.csv' in response.headers["content-disposition"]
        rows = list(csv.DictReader(io.StringIO(response.text)))
        assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [("1", "2.5", ""), ("2", "2.25", "")]
        assert "ranks" not in rows[0]

    def test_search_matches_name_model_and_owner(self, client, store) -> None:
        named = submitted(client, name="Sweep lr_a")
        other = submitted(client, name="other")
        ids = lambda q: [j["id"] for j in client.get("/v1/jobs", params={"q": q}).json()["data"]]  # noqa: E731
        assert ids("sweep") == [named["id"]]
        assert ids("lr_a") == [named["id"]] and ids("r%a") == []
        assert set(ids("tiny")) == {named["id"], other["id"]}
        assert set(ids("ADMIN")) == {named["id"], other["id"]} and ids("nobody") == []


def test_a_failure_shows_one_line_and_folds_the_stderr(client, store) -> None:
    job = submitted(client)
    with store.sessions() as session:
        service.transition(session, job["id"], JobStatus.running)
        message = ("model 'x' not found under the model root; copy it there or name a hub id\n"
                   "--- last 2 lines of the trainer's stderr ---\nTraceback (most recent call last):\nOSError: x")
        service.transition(session, job["id"], JobStatus.failed, error_code="model_not_found", error_message=message)
        session.commit()
    error = client.get(f"/v1/jobs/{job['id']}").json()["error"]
    assert error["message"] == "model 'x' not found under the model root; copy it there or name a hub id"
    assert error["detail"].startswith("--- last 2 lines") and error["detail"].endswith("OSError: x")


def test_a_second_claim_keeps_the_first_start(store, tmp_path) -> None:
    """A job handed back to the queue (worker shutdown) or retried keeps its started_at: run time
    counts from the first start, not from the resume."""
    import datetime as dt

    from sqlalchemy import update

    from core.settings import Settings
    from tests.fixtures.scheduling import add_job, runtime_for
    from worker.runner import claim_next_job

    settings = Settings(data_dir=tmp_path / "data", database_url=store.url).resolved()
    job_id = add_job(store)
    runtime = runtime_for(store, settings, "w")
    assert claim_next_job(runtime).job_id == job_id
    first = dt.datetime(2026, 11, 1, 12, 0, tzinfo=dt.UTC)
    with store.sessions.begin() as session:
        session.execute(update(Job).where(Job.job_id == job_id).values(started_at=first))
        service.transition(session, job_id, JobStatus.queued, worker_id=None)
    assert claim_next_job(runtime).job_id == job_id
    with store.sessions() as session:
        started = session.get(Job, job_id).started_at
    assert started.replace(tzinfo=dt.UTC) == first
