"""Experiment tracking in the worker: the dispatcher never holds a job up, a failing tracker is one
warning in the job's events in ftq's words, each listed server gets only its own credential, and
TensorBoard's own reader reads back what a real job run wrote."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select, update

from core.jobs.models import Job, JobEvent
from core.settings import TrackingServer
from worker.runner import run_job
from worker.tracking import JobInfo, TrackerFailure, Tracking, trackers_for
from worker.tracking.dispatch import describe
from worker.tracking.mlflow import flatten, metric_points

JOB = JobInfo(job_id="job-1", name="n", model="tiny", spec={"lora": {"r": 16}})


class Blocked:
    """A tracker whose ``log`` waits until released: a server that hangs."""

    label = "blocked"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.logged: list[dict] = []
        self.ended: tuple | None = None

    def start(self, job: JobInfo) -> None:
        pass

    def log(self, events: list[dict]) -> None:
        self.release.wait()
        self.logged.extend(events)

    def finish(self, status: str, artifact_dir: Path | None) -> None:
        self.ended = (status, artifact_dir)


class Broken(Blocked):
    label = "broken tracker"

    def log(self, events: list[dict]) -> None:
        raise TrackerFailure("HTTP 503 from runs/log-batch\nmore lines")


class Leaky(Blocked):
    """A library's exception that quotes what the server answered."""

    label = "leaky tracker"

    def start(self, job: JobInfo) -> None:
        raise RuntimeError("API request failed. Response body: 'root:x:0:0:root:/root:/bin/bash'")


class TestDispatch:
    def test_adding_events_never_waits_on_a_hung_tracker(self):
        hung = Blocked()
        tracking = Tracking([hung], JOB, warn=lambda m: None)
        for step in range(1, 2001):  # would block here if add waited on the tracker
            tracking.add({"type": "step", "step": step, "loss": 1.0})
        tracking.finish("succeeded")
        hung.release.set()
        assert tracking.join(30)
        assert [e["step"] for e in hung.logged] == list(range(1, 2001)) and hung.ended == ("succeeded", None)

    def test_a_failing_tracker_is_one_warning_and_the_others_go_on(self):
        warnings: list[str] = []
        good, bad = Blocked(), Broken()
        good.release.set()
        tracking = Tracking([bad, good], JOB, warn=warnings.append)
        for step in (1, 2):
            tracking.add({"type": "step", "step": step, "loss": 1.0})
        tracking.finish("failed")
        assert tracking.join(30)
        assert warnings == ["broken tracker: HTTP 503 from runs/log-batch; the job goes on without it"]
        assert len(good.logged) == 2 and good.ended == ("failed", None)

    def test_a_library_error_shows_its_class_never_its_text(self):
        warnings: list[str] = []
        tracking = Tracking([Leaky()], JOB, warn=warnings.append)
        tracking.finish("succeeded")
        assert tracking.join(30)
        assert warnings == ["leaky tracker: RuntimeError; the job goes on without it"]
        assert describe(ImportError("No module named 'mlflow'")) == "No module named 'mlflow'"  # local: kept

    def test_nothing_configured_is_a_no_op(self, settings, tmp_path):
        assert trackers_for({}, settings, job_id="j", output_dir=tmp_path, warn=print) == []
        tracking = Tracking([], JOB, warn=print)
        tracking.add({"type": "step", "step": 1})
        tracking.finish("succeeded")
        assert not tracking.active and tracking.join(0)

    def test_mlflow_asked_for_without_a_server_is_a_warning(self, settings, tmp_path):
        warnings: list[str] = []
        assert trackers_for({"tracking": {"mlflow": True}}, settings, job_id="j", output_dir=tmp_path,
                            warn=warnings.append) == []
        assert warnings == ["no MLflow server is named and the box marks none default: set tracking.mlflow_server, "
                            "or mark one of the box's FTQ_TRACKING_SERVERS default; the job goes on without MLflow"]


SERVERS = {
    "team": TrackingServer(kind="mlflow", url="http://team:5000", credential_env="TEAM_TOKEN"),
    "open": TrackingServer(kind="mlflow", url="http://open:5000"),
    "wb": TrackingServer(kind="wandb", url="https://wandb.example", credential_env="WB_KEY", default=True),
}
ENVIRON = {"TEAM_TOKEN": "team-secret", "WB_KEY": "wb-secret", "MLFLOW_TRACKING_TOKEN": "ambient",
           "WANDB_API_KEY": "ambient"}


class TestWhichTrackers:
    """The job's ``tracking`` over the box's settings (worker/tracking/resolve.py)."""

    def test_the_box_turns_tracking_on_for_every_job_and_a_job_may_opt_out(self, settings, tmp_path):
        box = settings.model_copy(update={"mlflow_tracking_uri": "http://mlflow:5000", "tensorboard_dir": tmp_path / "tb"})
        on = trackers_for({}, box, job_id="job-1", output_dir=tmp_path / "job", warn=print)
        assert [t.label for t in on] == ["MLflow server mlflow", f"TensorBoard files in {tmp_path / 'tb' / 'job-1'}"]
        assert (on[0].url, on[0].experiment) == ("http://mlflow:5000", "ftq")
        off = {"tracking": {"mlflow": False, "tensorboard": False}}
        assert trackers_for(off, box, job_id="job-1", output_dir=tmp_path, warn=print) == []

    def test_a_job_names_its_own_server_experiment_and_tensorboard(self, settings, tmp_path):
        box = settings.model_copy(update={"tracking_servers": SERVERS})
        spec = {"tracking": {"mlflow_server": "open", "mlflow_experiment": "sweeps", "tensorboard": True}}
        mlflow, tensorboard = trackers_for(spec, box, job_id="job-2", output_dir=tmp_path / "job", warn=print)
        assert (mlflow.label, mlflow.url, mlflow.experiment) == ("MLflow server open", "http://open:5000", "sweeps")
        assert tensorboard.logdir == tmp_path / "job" / "tensorboard"


class TestCredentials:
    """Each server gets the value of its own ``credential_env`` and nothing else of the worker's."""

    def trackers(self, settings, tmp_path, tracking, environ=ENVIRON, warn=print):
        box = settings.model_copy(update={"tracking_servers": SERVERS})
        return trackers_for({"tracking": tracking}, box, job_id="j", output_dir=tmp_path, warn=warn,
                            found={"mlflow": True, "tensorboard": True, "wandb": True}, environ=environ)

    def test_a_server_gets_its_own_token_and_one_without_a_credential_gets_none(self, settings, tmp_path):
        (team,) = self.trackers(settings, tmp_path, {"mlflow_server": "team"})
        (open_,) = self.trackers(settings, tmp_path, {"mlflow_server": "open"})
        assert (team._token, open_._token) == ("team-secret", None)  # not the ambient MLFLOW_TRACKING_TOKEN
        (legacy,) = self.trackers(settings, tmp_path, {"mlflow_tracking_uri": "http://team:5000/"})
        assert (legacy.label, legacy._token) == ("MLflow server team", "team-secret")

    def test_a_configured_variable_unset_on_the_worker_sends_nothing(self, settings, tmp_path):
        (team,) = self.trackers(settings, tmp_path, {"mlflow_server": "team"}, environ={"MLFLOW_TRACKING_TOKEN": "x"})
        assert team._token is None

    def test_w_and_b_gets_its_servers_url_and_key_explicitly(self, settings, tmp_path):
        (wandb,) = self.trackers(settings, tmp_path, {"wandb": True, "wandb_project": "p"})
        assert wandb._server_settings() == {"base_url": "https://wandb.example", "api_key": "wb-secret"}
        assert wandb.label == "W&B server wb, project p"

    def test_w_and_b_online_without_a_key_is_refused_before_w_and_b_looks_for_one(self, settings, tmp_path, monkeypatch):
        monkeypatch.delenv("WANDB_MODE", raising=False)
        (wandb,) = self.trackers(settings, tmp_path, {"wandb": True}, environ={"WANDB_API_KEY": "ambient"})
        with pytest.raises(TrackerFailure, match="W&B needs an API key and WB_KEY is not set on this worker"):
            wandb._server_settings()
        monkeypatch.setenv("WANDB_MODE", "offline")
        assert wandb._server_settings() == {"base_url": "https://wandb.example"}

    def test_an_unlisted_url_of_a_stored_job_is_a_warning_and_no_tracker(self, settings, tmp_path):
        warnings: list[str] = []
        assert self.trackers(settings, tmp_path, {"mlflow_tracking_uri": "http://127.0.0.1:8000"},
                             warn=warnings.append) == []
        assert warnings[0].startswith("tracking.mlflow_tracking_uri: jobs may send only to the tracking servers "
                                      "this box lists")
        assert warnings[0].endswith("(MLflow servers: open, team); nothing was sent to it, and the job goes on "
                                    "without MLflow")


def test_params_are_the_spec_flattened_and_metrics_the_numeric_step_and_eval_fields():
    assert flatten({"lora": {"r": 16, "target_modules": ["all-linear"]}, "name": None}) == {
        "lora.r": "16", "lora.target_modules": "['all-linear']", "name": "None"}
    points = metric_points([{"type": "step", "step": 3, "loss": 2.0, "lr": 1e-4, "grad_norm": None,
                             "gpu_alloc_retries": 2, "time": 10.0},
                            {"type": "eval", "step": 3, "loss": 1.5, "time": 11.0}, {"type": "log", "message": "x"}])
    assert points == [("train/loss", 2.0, 10000, 3), ("train/lr", 1e-4, 10000, 3),
                      ("train/gpu_alloc_retries", 2.0, 10000, 3), ("eval/loss", 1.5, 11000, 3)]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(predicate, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    return predicate()


@pytest.mark.slow
def test_a_job_writes_tensorboard_files_and_a_down_mlflow_is_a_warning_not_a_failure(runtime, make_job, settings):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    down = f"http://127.0.0.1:{_closed_port()}"
    runtime.settings = runtime.settings.model_copy(update={
        "tracking_servers": {"down": TrackingServer(kind="mlflow", url=down)}})
    job_id = make_job("fake:ok:5")
    with runtime.sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.job_id == job_id).values(
            spec={"tracking": {"tensorboard": True, "mlflow_server": "down"}}))

    assert run_job(runtime, job_id) == "succeeded"

    logdir = settings.jobs_dir / job_id / "tensorboard"

    def read_back():
        acc = EventAccumulator(str(logdir))
        acc.Reload()
        return acc if len(acc.Tags()["scalars"]) and len(acc.Scalars("train/loss")) == 5 else None

    acc = _wait_for(read_back)
    assert acc is not None, f"no TensorBoard scalars in {logdir}"
    assert [s.step for s in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert "spec" in acc.Tags()["tensors"]

    def warning():
        with runtime.sessionmaker() as session:
            rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "log")).all()
            return [e.data for e in rows if e.data.get("level") == "warning"]

    warned = _wait_for(warning)
    assert warned and warned[0]["message"] == "MLflow server down: ConnectError; the job goes on without it"
    assert warned[0]["source"] == "tracking"
    with runtime.sessionmaker() as session:
        assert session.get(Job, job_id).status == "succeeded"
