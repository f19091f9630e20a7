"""POST /v1/jobs refuses a tracker that no live worker has the package for (issue 22), naming the
field and the command that installs it; when the API cannot know, the job is accepted and a worker
without the package says so in the job's events, where the API and the job page show it.

The workers' rows hold ``{"trackers": {...}}`` as ``worker.presence`` stores it.
"""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.db import utcnow
from core.jobs.models import Job
from core.settings import Settings
from core.workers.models import Worker
from tests.integration.helpers import finish, spec, upload
from tests.integration.test_api_events import events_of
from worker.tracking import resolve

pytestmark = pytest.mark.integration

ALL = {"mlflow": True, "tensorboard": True, "wandb": True}


def add_worker(store, worker_id: str, hardware: dict[str, Any], age_s: float = 0.0) -> None:
    with store.sessions.begin() as session:
        session.add(Worker(worker_id=worker_id, hostname="box", device="cpu", hardware=hardware,
                           started_at=utcnow(), heartbeat_at=utcnow() - dt.timedelta(seconds=age_s)))


def jobs(store) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(Job))


class TestRefusedAtSubmission:
    def test_a_tracker_no_live_worker_has_is_422_naming_field_extra_and_command(
        self, client: TestClient, store
    ) -> None:
        add_worker(store, "box-a/gpu0", {"trackers": {**ALL, "wandb": False}})
        add_worker(store, "box-gone/gpu0", {"trackers": ALL}, age_s=3600)  # not live: does not count
        response = client.post("/v1/jobs", json=spec(upload(client), tracking={"wandb": True, "wandb_project": "p"}))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported", "tracking.wandb")
        assert "the wandb package is not installed on worker box-a/gpu0" in error["message"]
        assert "'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install 'ftq[tracking]'" in error["message"]
        assert jobs(store) == 0

    def test_naming_a_server_asks_for_the_tracker_too(self, client: TestClient, store) -> None:
        add_worker(store, "box-a/gpu0", {"trackers": {**ALL, "mlflow": False}})
        body = spec(upload(client), tracking={"mlflow_tracking_uri": "http://mlflow:5000"})
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 422 and response.json()["error"]["param"] == "tracking.mlflow_tracking_uri"
        body["tracking"]["mlflow"] = False
        assert client.post("/v1/jobs", json=body).status_code == 201

    def test_one_live_worker_with_the_package_is_enough(self, client: TestClient, store) -> None:
        add_worker(store, "box-a/gpu0", {"trackers": {**ALL, "tensorboard": False}})
        add_worker(store, "box-b/gpu0", {"trackers": ALL})
        response = client.post("/v1/jobs", json=spec(upload(client), tracking={"tensorboard": True}))
        assert response.status_code == 201, response.text
        shown = {w["id"]: w["trackers"] for w in client.get("/v1/hardware").json()["data"]}
        assert shown == {"box-a/gpu0": {**ALL, "tensorboard": False}, "box-b/gpu0": ALL}

    def test_accepted_when_no_live_worker_or_one_that_did_not_say(self, client: TestClient, store) -> None:
        file_id = upload(client)
        assert client.post("/v1/jobs", json=spec(file_id, tracking={"wandb": True})).status_code == 201
        add_worker(store, "box-a/gpu0", {"trackers": {**ALL, "wandb": False}})
        add_worker(store, "box-old/gpu0", {})  # an older worker, or one still registering
        assert client.post("/v1/jobs", json=spec(file_id, tracking={"wandb": True})).status_code == 201
        assert jobs(store) == 2


def test_a_worker_without_the_package_warns_in_the_jobs_events_and_the_job_goes_on(
    client: TestClient, store, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    response = client.post("/v1/jobs", json=spec(upload(client), tracking={"wandb": True, "tensorboard": True}))
    assert response.status_code == 201, response.text  # no live worker: the API cannot know
    job_id = response.json()["id"]
    monkeypatch.setattr(resolve, "installed", lambda: {**ALL, "wandb": False})
    published: list[int] = []
    runtime = SimpleNamespace(sessionmaker=store.sessions, settings=settings, worker_id="box-a/gpu0",
                              publish=lambda job, seq: published.append(seq))

    tracking = resolve.tracking_for(runtime, job_id, settings.jobs_dir / job_id)
    assert [lane.tracker.label for lane in tracking._lanes] == [
        f"TensorBoard files in {settings.jobs_dir / job_id / 'tensorboard'}"]  # the rest still tracks
    tracking.finish("succeeded")
    assert tracking.join(30)
    finish(store, job_id)

    events = events_of(client.get(f"/v1/jobs/{job_id}/events").text)
    (warning,) = [e for e in events if e["event"] == "log"]
    assert warning["data"]["level"] == "warning" and warning["data"]["source"] == "tracking"
    assert warning["data"]["message"] == (
        "tracking.wandb: the wandb package is not installed on worker box-a/gpu0, so the job goes on without "
        "W&B; to track with it, install the 'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install "
        "'ftq[tracking]' on the worker host, then restart the worker")
    assert published == [int(warning["id"])]  # live viewers were woken
    openai_events = client.get(f"/openai/v1/fine_tuning/jobs/{job_id}/events").json()["data"]
    assert any(e["level"] == "warn" and e["message"] == warning["data"]["message"] for e in openai_events)
