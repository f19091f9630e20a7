"""Daily-use client behaviour against the real API app in process: step lines off a terminal, a
failure's one line, download hints, rerun/resume/metrics, the saved URL, the jobs table cells."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from cli import client as cli_client
from cli import config
from cli.errors import CliError
from cli.jobs import _explain_missing, duration_cell, follow, load_job_file, loss_cells, submit
from cli.runs import parse_sets, rerun, resume
from core.db import make_engine, make_sessionmaker
from core.jobs import service
from core.jobs.models import Checkpoint, Job
from core.jobs.states import JobStatus
from core.migrate import upgrade
from core.settings import Settings
from tests.helpers import create_api_key
from trainer.training import layout


@pytest.fixture
def box(tmp_path: Path, model_root: Path) -> Iterator[SimpleNamespace]:
    """The app on a fresh SQLite store (a client sending an admin's key) and a session maker on it."""
    settings = Settings(data_dir=tmp_path / "data", model_root=model_root, allow_hub_models=False,
                        sse_poll_interval_s=0.05).resolved()
    upgrade(settings.database_url)
    key = create_api_key(settings.database_url)
    engine = make_engine(settings.database_url)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {key}"}) as client:
        yield SimpleNamespace(client=client, sessions=make_sessionmaker(engine))
    engine.dispose()


def a_job(box: SimpleNamespace, job_file: Path) -> str:
    return submit(box.client, load_job_file(job_file), base_dir=job_file.parent)["id"]


def run_to(box: SimpleNamespace, job_id: str, status: JobStatus, *, checkpoints=(), **error) -> None:
    """The worker's part, written to the store: two steps, an eval, checkpoints, the end state."""
    with box.sessions() as session:
        service.transition(session, job_id, JobStatus.running)
        output_dir = session.get(Job, job_id).output_dir
        events = [("step", {"step": s, "total_steps": 2, "loss": 2.0 / s, "tokens_per_s": 100.0}) for s in (1, 2)]
        events.append(("eval", {"step": 2, "loss": 1.2345678901234567}))
        for step in checkpoints:
            path = layout.checkpoint_dir(output_dir, step)
            path.mkdir(parents=True)
            (path / "trainer_state.json").write_text("{}")
            session.add(Checkpoint(job_id=job_id, step=step, path=str(path), bytes=2, final=False))
        service.transition(session, job_id, status, **error)
        events.append(service.state_event(status, **({"error_code": error["error_code"],
                                                       "message": error["error_message"]} if error else {})))
        service.append_events(session, job_id, events)
        session.commit()


class TestFollowOffATerminal:
    def test_every_step_and_a_short_eval_loss_are_printed(self, box, job_file):
        job_id = a_job(box, job_file)
        run_to(box, job_id, JobStatus.succeeded)
        out = io.StringIO()
        assert follow(box.client, job_id, out) == 0
        lines = out.getvalue().splitlines()
        assert [line for line in lines if "step 1/2" in line or "step 2/2" in line][0].endswith("loss 2.0000  100 tok/s")
        assert len([line for line in lines if "] step " in line]) == 2
        assert "eval: step 2 loss 1.2346" in lines

    def test_a_failure_prints_its_one_line_cause(self, box, job_file):
        job_id = a_job(box, job_file)
        run_to(box, job_id, JobStatus.failed, error_code="model_not_found",
               error_message="model 'x' is not under the model root; copy it there\n--- stderr ---\nTraceback")
        out = io.StringIO()
        assert follow(box.client, job_id, out) == 1
        assert out.getvalue().splitlines()[-1] == (
            "state: failed (model_not_found: model 'x' is not under the model root; copy it there)")


class TestDownloadHints:
    def test_a_cancelled_jobs_adapter_points_to_its_checkpoints(self, box, job_file):
        job_id = a_job(box, job_file)
        run_to(box, job_id, JobStatus.cancelled, checkpoints=[1])
        args = SimpleNamespace(job_id=job_id, step=None)
        with pytest.raises(CliError, match=rf"is cancelled.*at step 1: `ftq download {job_id} --step 1`"):
            _explain_missing(box.client, args, None)
        with pytest.raises(CliError, match=r"no checkpoint at step 5; its checkpoints are at step 1: `ftq download"):
            _explain_missing(box.client, SimpleNamespace(job_id=job_id, step=5), None)


class TestRerunAndResume:
    def test_set_keys_are_qualified_from_the_apis_schema(self, box):
        schema = box.client.get("/openapi.json").json()
        assert parse_sets(["learning_rate=1e-4", "lora.r=32", "alpha=8", "name=lr test", "epochs=null"], schema) == {
            "hyperparameters": {"learning_rate": 1e-4, "epochs": None}, "lora": {"r": 32, "alpha": 8},
            "name": "lr test"}
        with pytest.raises(CliError, match="KEY=VALUE"):
            parse_sets(["learning_rate"], schema)

    def test_rerun_submits_a_changed_copy_and_resume_continues_from_a_checkpoint(self, box, job_file):
        job_id = a_job(box, job_file)
        copy = rerun(box.client, job_id, ["learning_rate=1e-4", "name=lower"])
        assert copy["spec"]["hyperparameters"]["learning_rate"] == 1e-4 and copy["name"] == "lower"
        with pytest.raises(CliError, match=r"422: .*hyperparameters\.learning_rate"):
            rerun(box.client, job_id, ["learning_rate=7"])
        run_to(box, job_id, JobStatus.failed, checkpoints=[1, 2], error_code="x", error_message="y")
        resumed = resume(box.client, job_id, 1)
        assert [c["step"] for c in box.client.get(f"/v1/jobs/{resumed['id']}/checkpoints").json()["data"]] == [1]
        with pytest.raises(CliError, match="404: .*at step 1, 2"):
            resume(box.client, job_id, 9)


def test_metrics_command_writes_the_csv(box, job_file, tmp_path, monkeypatch):
    from cli import runs

    job_id = a_job(box, job_file)
    monkeypatch.setattr(runs, "connect", lambda: contextlib.nullcontext(box.client))
    target = tmp_path / "m.csv"
    assert runs.run_metrics(SimpleNamespace(job_id=job_id, output=target)) == 0
    assert target.read_text().startswith("step,epoch,loss,")


def test_ftq_up_saves_the_url_a_new_shell_then_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("FTQ_CONFIG", str(tmp_path / "config.toml"))
    for name in ("FTQ_API_URL", "FTQ_PORT", "FTQ_HOST"):
        monkeypatch.delenv(name, raising=False)
    config.save_config({"api_key": "ftq-secret"})
    assert config.remember_api_url("http://127.0.0.1:8123") == tmp_path / "config.toml"
    assert cli_client.api_url() == "http://127.0.0.1:8123"
    assert config.api_key() == "ftq-secret"  # the key stays


def test_jobs_table_cells():
    job = {"started_at": "2026-11-24T01:00:00+00:00", "finished_at": "2026-11-24T02:02:30+00:00"}
    assert duration_cell(job) == "1h02m"
    now = dt.datetime(2026, 11, 24, 1, 3, 5, tzinfo=dt.UTC)
    assert duration_cell({"started_at": "2026-11-24T01:00:00Z", "finished_at": None}, now) == "3m05s"
    assert duration_cell({"started_at": None}) == "-"
    summary = {"final_train_loss": 1.23456, "best_train_loss": 1.1, "best_eval_loss": None}
    assert loss_cells({"summary": summary}) == ("1.2346", "1.1000")
    assert loss_cells({"summary": {**summary, "best_eval_loss": 0.9}}) == ("1.2346", "0.9000e")
    assert loss_cells({}) == ("-", "-")
