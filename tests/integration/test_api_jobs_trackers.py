"""POST /v1/jobs refuses a tracker that no live worker has the package for (issue 22), naming the
field and the command that installs it; when the API cannot know, the job is accepted and a worker
without the package says so in the job's events, where the API and the job page show it.

Tracking servers are the box's allow-list (issue 23 item 3): two real listeners on 127.0.0.1 stand
in for MLflow servers, ``team`` (configured with the worker's ``FTQ_TEST_TEAM_TOKEN``) and ``open``
(no credential), each recording the ``Authorization`` header of every request and answering 500
with a secret body. An unlisted URL is 422 at submission; the worker sends each server only its
own credential (never the ambient ``MLFLOW_TRACKING_TOKEN``), never contacts an unlisted URL of a
stored job, and the failure in the job's events is ftq's message, without the body.

The workers' rows hold ``{"trackers": {...}}`` as ``worker.presence`` stores it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.db import utcnow
from core.jobs.models import Job
from core.settings import Settings, TrackingServer
from core.workers.models import Worker
from tests.fixtures.events import events_of
from tests.fixtures.trackers import ALL, AMBIENT_TOKEN, SECRET, TEAM_TOKEN, Listener, jobs, run_tracking
from tests.integration.helpers import finish, spec, upload
from worker.tracking import resolve

pytestmark = pytest.mark.integration

@pytest.fixture
def listeners() -> Iterator[dict[str, Listener]]:
    """``team`` and ``open``, listed; ``unlisted``, a service on the loopback no list names."""
    started = {name: Listener() for name in ("team", "open", "unlisted")}
    yield started
    for listener in started.values():
        listener.close()


@pytest.fixture
def settings(settings: Settings, listeners: dict[str, Listener]) -> Settings:
    """The API's and the worker's settings list ``team`` and ``open`` (the same JSON on both)."""
    return settings.model_copy(update={"tracking_servers": {
        "team": TrackingServer(kind="mlflow", url=listeners["team"].url, credential_env="FTQ_TEST_TEAM_TOKEN"),
        "open": TrackingServer(kind="mlflow", url=listeners["open"].url)}})


def add_worker(store, worker_id: str, hardware: dict[str, Any], age_s: float = 0.0) -> None:
    with store.sessions.begin() as session:
        session.add(Worker(worker_id=worker_id, hostname="box", device="cpu", hardware=hardware,
                           started_at=utcnow(), heartbeat_at=utcnow() - dt.timedelta(seconds=age_s)))


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
        body = spec(upload(client), tracking={"mlflow_server": "open"})
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 422 and response.json()["error"]["param"] == "tracking.mlflow_server"
        assert response.json()["error"]["code"] == "unsupported"
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


class TestOnlyListedServers:
    def test_an_unlisted_url_is_422_naming_the_field_and_the_servers_and_nothing_is_sent(
        self, client: TestClient, store, listeners: dict[str, Listener]
    ) -> None:
        file_id = upload(client)
        for uri in (listeners["unlisted"].url, "http://127.0.0.1:8000/v1/files", f"{listeners['team'].url}/x"):
            response = client.post("/v1/jobs", json=spec(file_id, tracking={"mlflow_tracking_uri": uri}))
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_input", "tracking.mlflow_tracking_uri")
            assert error["message"].endswith("name one with tracking.mlflow_server instead (MLflow servers: open, team)")
        response = client.post("/v1/jobs", json=spec(file_id, tracking={"mlflow_server": "elsewhere"}))
        assert response.status_code == 422
        assert response.json()["error"] == {
            "code": "invalid_input", "param": "tracking.mlflow_server",
            "message": "tracking.mlflow_server: 'elsewhere' is not an MLflow server of this box; MLflow servers: open, team"}
        assert jobs(store) == 0 and all(not listener.seen for listener in listeners.values())

    def test_a_listed_url_is_taken_and_reads_back_as_given(self, client: TestClient, listeners) -> None:
        body = spec(upload(client), tracking={"mlflow_tracking_uri": listeners["open"].url + "/"})
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        stored = client.get(f"/v1/jobs/{response.json()['id']}").json()["spec"]["tracking"]
        assert stored["mlflow_tracking_uri"] == listeners["open"].url + "/" and stored["mlflow_server"] is None


class TestTheWorkersCredentials:
    @pytest.fixture(autouse=True)
    def worker_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("FTQ_TEST_TEAM_TOKEN", TEAM_TOKEN)
        monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", AMBIENT_TOKEN)  # what MLflow's own client would send anywhere
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ambient-user")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", AMBIENT_TOKEN)
        monkeypatch.setattr(resolve, "installed", lambda: ALL)

    def submit(self, client: TestClient, tracking: dict[str, Any]) -> str:
        response = client.post("/v1/jobs", json=spec(upload(client), tracking=tracking))
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def test_a_server_without_a_credential_gets_no_authorization(self, client, store, settings, listeners) -> None:
        run_tracking(store, settings, self.submit(client, {"mlflow_server": "open"}))
        assert listeners["open"].authorizations == [None]
        assert not listeners["team"].seen and not listeners["unlisted"].seen

    def test_the_token_goes_only_to_its_own_server(self, client, store, settings, listeners) -> None:
        run_tracking(store, settings, self.submit(client, {"mlflow_server": "team"}))
        run_tracking(store, settings, self.submit(client, {"mlflow_tracking_uri": listeners["team"].url}))
        run_tracking(store, settings, self.submit(client, {"mlflow_server": "open"}))
        assert listeners["team"].authorizations == [f"Bearer {TEAM_TOKEN}"] * 2
        assert listeners["open"].authorizations == [None]
        assert not listeners["unlisted"].seen

    def test_an_unlisted_url_of_a_stored_job_is_never_contacted(self, client, store, settings, listeners) -> None:
        job_id = self.submit(client, {})
        with store.sessions.begin() as session:  # as a job stored before the allow-list keeps it
            job = session.get(Job, job_id)
            job.spec = {**job.spec, "tracking": {"mlflow_tracking_uri": listeners["unlisted"].url}}
        run_tracking(store, settings, job_id)
        assert all(not listener.seen for listener in listeners.values())
        (warning,) = [e for e in events_of(client.get(f"/v1/jobs/{job_id}/events").text) if e["event"] == "log"]
        assert warning["data"]["message"].endswith(
            "(MLflow servers: open, team); nothing was sent to it, and the job goes on without MLflow")

    def test_an_erroring_servers_body_never_reaches_the_jobs_events(self, client, store, settings, listeners) -> None:
        job_id = self.submit(client, {"mlflow_server": "team"})
        run_tracking(store, settings, job_id)
        assert listeners["team"].seen  # it was asked, and answered 500 with the secret
        native = client.get(f"/v1/jobs/{job_id}/events").text
        openai = client.get(f"/openai/v1/fine_tuning/jobs/{job_id}/events").text
        (warning,) = [e for e in events_of(native) if e["event"] == "log"]
        assert warning["data"]["message"] == ("MLflow server team: HTTP 500 from experiments/get-by-name; "
                                              "the job goes on without it")
        for served in (native, openai, client.get(f"/v1/jobs/{job_id}").text):
            assert SECRET not in served and TEAM_TOKEN not in served and "root:x:0:0" not in served
