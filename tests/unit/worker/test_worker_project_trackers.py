"""The worker applies a project's tracking-server list (issue 23 item 3) as the API does at
submission: a stored job whose project lost a server since gets a warning event and no tracker for
it; the box's default servers turn trackers on only for projects that may use them. And the
trainer's environment carries none of the trackers' credentials (worker/launch.py ``trainer_env``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import select

from core.db import new_id
from core.jobs.models import Job, JobEvent
from core.jobs.trackers import allowed_trackers
from core.projects.models import Project
from core.settings import TrackingServer
from worker.launch import trainer_env
from worker.tracking import trackers_for
from worker.tracking.resolve import tracking_for

FOUND = {"mlflow": True, "tensorboard": True, "wandb": True}
SERVERS = {
    "team": TrackingServer(kind="mlflow", url="http://team:5000", credential_env="TEAM_TOKEN", default=True),
    "open": TrackingServer(kind="mlflow", url="http://open:5000"),
    "wb": TrackingServer(kind="wandb", url="https://wandb.example", credential_env="WB_KEY", default=True),
}


@pytest.fixture
def box(settings):
    return settings.model_copy(update={"tracking_servers": SERVERS, "wandb_project": "everything"})


def run(box, tmp_path, tracking, servers):
    warnings: list[str] = []
    trackers = trackers_for({"tracking": tracking}, box, job_id="j", output_dir=tmp_path, warn=warnings.append,
                            found=FOUND, environ={}, servers=servers)
    return [t.label for t in trackers], warnings


class TestTheProjectsList:
    def test_a_server_the_project_may_not_use_is_a_warning_and_no_tracker(self, box, tmp_path):
        labels, warnings = run(box, tmp_path, {"mlflow_server": "team", "wandb": False},
                               allowed_trackers(box, Project(name="vision", tracking_servers=["open"])))
        assert labels == []
        assert warnings == ["tracking.mlflow_server: project 'vision' may not use the MLflow server 'team'; MLflow "
                            "servers project 'vision' may use: open; nothing was sent to it, and the job goes on "
                            "without MLflow"]

    def test_the_boxs_defaults_track_only_projects_that_may_use_them(self, box, tmp_path):
        assert run(box, tmp_path, {}, allowed_trackers(box)) == (
            ["MLflow server team", "W&B server wb, project everything"], [])
        assert run(box, tmp_path, {}, allowed_trackers(box, Project(name="vision", tracking_servers=["open"]))) == (
            [], [])
        labels, _ = run(box, tmp_path, {"mlflow_server": "open"},
                        allowed_trackers(box, Project(name="vision", tracking_servers=["open"])))
        assert labels == ["MLflow server open"]

    def test_turning_mlflow_on_where_the_project_lacks_the_default_is_a_warning(self, box, tmp_path):
        labels, warnings = run(box, tmp_path, {"mlflow": True, "wandb": False},
                               allowed_trackers(box, Project(name="vision", tracking_servers=[])))
        assert labels == []
        assert warnings[0].startswith("tracking.mlflow: project 'vision' may not use the box's default MLflow "
                                      "server 'team'; project 'vision' may use no MLflow server")
        assert warnings[0].endswith("nothing was sent to it, and the job goes on without MLflow")


def test_a_stored_job_whose_project_lost_the_server_gets_a_warning_event(runtime, make_job, box, tmp_path):
    project_id = new_id("proj")
    with runtime.sessionmaker.begin() as session:
        session.add(Project(project_id=project_id, name="vision", tracking_servers=None))
    job_id = make_job("fake:ok:1", project_id=project_id)
    with runtime.sessionmaker.begin() as session:  # submitted while all the box's were allowed
        session.get(Job, job_id).spec = {"tracking": {"mlflow_server": "team", "wandb": False}}
        session.get(Project, project_id).tracking_servers = ["open"]  # narrowed since
    worker = SimpleNamespace(sessionmaker=runtime.sessionmaker, settings=box, worker_id="box-a/gpu0",
                             publish=lambda job, seq: None)
    tracking = tracking_for(worker, job_id, tmp_path)
    assert not tracking.active
    with runtime.sessionmaker() as session:
        logs = [e.data for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "log"))]
    assert [(log["level"], log["source"]) for log in logs] == [("warning", "tracking")]
    assert logs[0]["message"].startswith("tracking.mlflow_server: project 'vision' may not use the MLflow server 'team'")


def test_the_trainer_env_has_none_of_the_tracking_credentials(runtime, box, monkeypatch):
    hidden = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY",
              "TEAM_TOKEN", "WB_KEY")
    for name in hidden:
        monkeypatch.setenv(name, f"secret-{name}")
    monkeypatch.setenv("FTQ_TEST_KEPT", "kept")
    env = trainer_env(SimpleNamespace(options=runtime.options, settings=box))
    assert [name for name in hidden if name in env] == []
    assert not any(value.startswith("secret-") for value in env.values())
    assert env["FTQ_TEST_KEPT"] == "kept"
