"""Weights & Biases in the worker, offline (``WANDB_MODE=offline``, a temp ``WANDB_DIR``): a job's run
file, read back with wandb's own reader, holds the spec as config, the step metrics by step, the
adapter artifact and the exit code; a worker without a tracker's package says so in the job's
events; the worker reports which trackers' packages it has. The runs of real jobs are ``slow``:
W&B's service process and its reader each take seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from core.jobs.models import Job, JobEvent, StepMetric
from core.workers.models import Worker
from trainer.training import layout
from worker.presence import Presence
from worker.runner import run_job
from worker.tracking import JobInfo, Tracking, installed, resolve
from worker.tracking.wandb import WandbTracker, by_step


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline, its files under a temp ``WANDB_DIR``; its service process stopped afterwards."""
    pytest.importorskip("wandb")
    directory = tmp_path / "wandb-dir"
    directory.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(directory))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield directory
    import wandb

    wandb.teardown()


def read_run(run_file: Path) -> dict[str, Any]:
    """An offline run's ``.wandb`` file as wandb's own reader prints it (``wandb leet inspect --json``,
    one JSON line per record): its run record, config, history rows, summary, artifacts and exit code."""
    done = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run_file)],
                          capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "WANDB_MODE": "offline"})  # offline: no telemetry either
    out: dict[str, Any] = {"run": {}, "config": {}, "history": [], "summary": {}, "artifacts": [], "exit_code": None}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        kind = record["type"]
        if kind == "run":
            out["run"] = record["run"]
            out["config"].update(record["run"].get("config", {}).get("update", {}))
        elif kind == "config":
            out["config"].update(record["config"].get("update", {}))
        elif kind == "history":
            out["history"].append(record["history"]["item"])
        elif kind == "summary":
            out["summary"].update(record["summary"].get("update", {}))
        elif kind == "artifact":
            out["artifacts"].append(record["artifact"])
        elif kind == "exit":
            out["exit_code"] = record["exit"].get("exit_code", 0)
    return out


def finished_runs(wandb_dir: Path, count: int = 1, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The offline runs under ``wandb_dir`` once ``count`` of them have their exit record (the
    tracker finishes on its own thread, after the job)."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [read_run(path) for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))]
        if len([r for r in runs if r["exit_code"] is not None]) >= count or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def set_spec(runtime, job_id: str, spec: dict[str, Any]) -> None:
    with runtime.sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.job_id == job_id).values(spec=spec))


@pytest.mark.slow
def test_a_job_is_an_offline_wandb_run_with_config_metrics_by_step_and_the_adapter(
    runtime, make_job, settings, wandb_dir
):
    job_id = make_job("fake:ok:5", name="lr sweep a")
    set_spec(runtime, job_id, {"hyperparameters": {"learning_rate": 0.0002, "max_steps": 5},
                               "tracking": {"wandb": True, "wandb_project": "ftq-test", "wandb_name": "run a",
                                            "wandb_tags": ["lora", "r16"]}})
    adapter = layout.export_dir(settings.jobs_dir / job_id, "lora")  # what the real trainer writes at the end
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 16}')

    assert run_job(runtime, job_id) == "succeeded"

    (run,) = finished_runs(wandb_dir)
    assert (run["run"]["project"], run["run"]["display_name"], run["run"]["tags"]) == ("ftq-test", "run a", ["lora", "r16"])
    assert run["config"]["job_id"] == job_id and run["config"]["model"] == "fake:ok:5"
    assert run["config"]["hyperparameters"] == {"learning_rate": 0.0002, "max_steps": 5}
    with runtime.sessionmaker() as session:
        stored = {row.step: row.loss for row in session.scalars(select(StepMetric).where(StepMetric.job_id == job_id))}
    logged = {row["_step"]: row["train/loss"] for row in run["history"] if "train/loss" in row}
    assert logged == stored and sorted(logged) == [1, 2, 3, 4, 5]
    assert run["summary"]["ftq/status"] == "succeeded" and run["summary"]["ftq/job_id"] == job_id
    assert [(a["name"], a["type"]) for a in run["artifacts"]] == [(f"ftq-{job_id}", "model")]
    assert run["exit_code"] == 0
    assert "git" not in run["run"], "the worker's metadata is not the training's"


@pytest.mark.slow
def test_a_failed_job_fails_its_run(runtime, make_job, wandb_dir):
    job_id = make_job("fake:fail")
    set_spec(runtime, job_id, {"tracking": {"wandb_project": "ftq-test"}})
    assert run_job(runtime, job_id) == "failed"
    (run,) = finished_runs(wandb_dir)
    assert run["exit_code"] == 1 and run["summary"]["ftq/status"] == "failed" and not run["artifacts"]


@pytest.mark.slow
def test_two_jobs_at_once_on_one_worker_log_into_their_own_runs(tmp_path, wandb_dir):
    jobs = [JobInfo(job_id=f"job-{i}", name=None, model="tiny") for i in (1, 2)]
    warnings: list[str] = []
    trackings = [Tracking([WandbTracker(project="ftq-test", directory=tmp_path)], job, warn=warnings.append)
                 for job in jobs]
    for step in (1, 2, 3):
        for i, tracking in enumerate(trackings, start=1):
            tracking.add({"type": "step", "step": step, "loss": 10.0 * i + step})
    for tracking in trackings:
        tracking.finish("succeeded")
        assert tracking.join(120)
    assert warnings == []
    runs = {run["run"]["display_name"]: run for run in finished_runs(wandb_dir, count=2)}
    assert {name: [row["train/loss"] for row in run["history"]] for name, run in runs.items()} == {
        "job-1": [11.0, 12.0, 13.0], "job-2": [21.0, 22.0, 23.0]}


def test_a_worker_without_the_package_warns_with_the_fix_and_the_job_goes_on(runtime, make_job, monkeypatch):
    monkeypatch.setattr(resolve, "installed", lambda: {"mlflow": True, "tensorboard": True, "wandb": False})
    job_id = make_job("fake:ok:2")
    set_spec(runtime, job_id, {"tracking": {"wandb": True}})

    assert run_job(runtime, job_id) == "succeeded"

    with runtime.sessionmaker() as session:
        logs = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "log")).all()
    (warning,) = [e.data for e in logs if e.data.get("source") == "tracking"]
    assert warning["level"] == "warning"
    assert warning["message"].startswith("tracking.wandb: the wandb package is not installed on worker "
                                         "test-host/gpu3, so the job goes on without W&B; to track with it, "
                                         "install the 'tracking' extra: make up SERVICE_EXTRAS=tracking")


def test_a_box_setting_names_itself_in_the_warning(settings, tmp_path):
    box = settings.model_copy(update={"wandb_project": "team"})
    warnings: list[str] = []
    found = {"mlflow": True, "tensorboard": True, "wandb": False}
    assert resolve.trackers_for({}, box, job_id="j", output_dir=tmp_path, warn=warnings.append, found=found,
                                host="h") == []
    assert warnings[0].startswith("FTQ_WANDB_PROJECT: the wandb package is not installed on worker h")
    tracker, = resolve.trackers_for({}, box, job_id="j", output_dir=tmp_path, warn=pytest.fail,
                                    found={**found, "wandb": True})
    assert (tracker.project, tracker.label) == ("team", "W&B server wandb, project team")
    assert resolve.trackers_for({"tracking": {"wandb": False}}, box, job_id="j", output_dir=tmp_path,
                                warn=pytest.fail, found=found) == []


def test_the_worker_reports_which_trackers_it_can_import(runtime):
    presence = Presence(runtime, detect=False)
    presence.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with runtime.sessionmaker() as session:
                row = session.get(Worker, "test-host/gpu3")
            if row is not None and row.hardware:
                break
            time.sleep(0.05)
    finally:
        presence.stop()
    assert row.hardware == {"trackers": installed()}
    assert set(installed()) == {"mlflow", "tensorboard", "wandb"}


def test_metrics_are_one_row_per_step_in_arrival_order():
    points = [("train/loss", 2.0, 0, 3), ("train/lr", 1e-4, 0, 3), ("eval/loss", 1.5, 0, 3), ("train/loss", 1.9, 0, 4)]
    assert by_step(points) == [(3, {"train/loss": 2.0, "train/lr": 1e-4, "eval/loss": 1.5}), (4, {"train/loss": 1.9})]
