"""A project's tracking servers (issue 23 item 3), on PostgreSQL and SQLite: a global admin narrows
the box's list per project through ``/v1/projects`` (an unknown name is 422 naming
``tracking_servers`` and listing the box's); a job naming a server its project may not use, or
turning a tracker on where its project lacks the box's default, is refused at submission with a
422 naming the field and what the project may use, nothing stored; the worker applies the same list
to stored jobs: a server the project lost is a warning event and never contacted, and the box's
default tracks only the projects that may use it. Real listeners on 127.0.0.1 stand in for the
MLflow servers (``tests.fixtures.trackers.Listener``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings, TrackingServer
from tests.fixtures.events import events_of
from tests.fixtures.trackers import ALL, TEAM_TOKEN, Listener, jobs, run_tracking
from tests.integration.helpers import bearer, spec
from worker.tracking import resolve

pytestmark = pytest.mark.integration


@pytest.fixture
def listeners() -> Iterator[dict[str, Listener]]:
    started = {name: Listener() for name in ("team", "open")}
    yield started
    for listener in started.values():
        listener.close()


@pytest.fixture
def settings(settings: Settings, listeners: dict[str, Listener]) -> Settings:
    """The box lists ``team`` (the default MLflow server, with a credential) and ``open``; W&B is the implicit ``wandb``."""
    return settings.model_copy(update={"tracking_servers": {
        "team": TrackingServer(kind="mlflow", url=listeners["team"].url, credential_env="FTQ_TEST_TEAM_TOKEN",
                               default=True),
        "open": TrackingServer(kind="mlflow", url=listeners["open"].url)}})


@pytest.fixture(autouse=True)
def worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTQ_TEST_TEAM_TOKEN", TEAM_TOKEN)
    monkeypatch.setattr(resolve, "installed", lambda: ALL)


def make_project(client: TestClient, name: str, servers: list[str] | None) -> None:
    response = client.post("/v1/projects", json={"name": name, "tracking_servers": servers})
    assert response.status_code == 201, response.text
    assert response.json()["tracking_servers"] == servers


def upload_to(client: TestClient, project: str) -> str:
    response = client.post("/v1/files", files={"file": ("d.jsonl", '{"messages": [{"role": "user", "content": "hi"}, '
                                                        '{"role": "assistant", "content": "yo"}]}\n')},
                           data={"purpose": "train", "project": project})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def submit(client: TestClient, project: str, tracking: dict[str, Any]):
    return client.post("/v1/jobs", json=spec(upload_to(client, project), project=project, tracking=tracking))


class TestSettingTheList:
    def test_a_global_admin_sets_and_clears_it_and_an_unknown_name_is_422_listing_the_boxs(self, client, store):
        make_project(client, "vision", ["open"])
        refused = client.patch("/v1/projects/vision", json={"tracking_servers": ["open", "elsewhere"]})
        assert refused.status_code == 422
        assert refused.json()["error"]["param"] == "tracking_servers"
        assert refused.json()["error"]["message"].startswith(
            "tracking_servers: 'elsewhere' is not a tracking server of this box; its servers: open, team, wandb")
        assert client.get("/v1/projects/vision").json()["tracking_servers"] == ["open"]  # nothing changed
        assert client.patch("/v1/projects/vision", json={"tracking_servers": ["wandb", "open", "open"]}).json()[
            "tracking_servers"] == ["open", "wandb"]
        assert client.patch("/v1/projects/vision", json={"max_gpus": 2}).json()["tracking_servers"] == ["open", "wandb"]
        assert client.patch("/v1/projects/vision", json={"tracking_servers": []}).json()["tracking_servers"] == []
        assert client.patch("/v1/projects/vision", json={"tracking_servers": None}).json()["tracking_servers"] is None
        created = client.post("/v1/projects", json={"name": "nlp", "tracking_servers": ["nope"]})
        assert created.status_code == 422 and created.json()["error"]["param"] == "tracking_servers"
        assert client.get("/v1/projects/nlp").status_code == 404  # not made

    def test_a_member_may_not_change_it(self, client):
        make_project(client, "vision", None)
        member = client.post("/v1/users", json={"name": "carol", "projects": ["vision"]}).json()["api_key"]
        response = client.patch("/v1/projects/vision", json={"tracking_servers": ["team"]}, headers=bearer(member))
        assert response.status_code == 403
        assert client.get("/v1/projects/vision").json()["tracking_servers"] is None


class TestRefusedAtSubmission:
    def test_a_server_the_project_may_not_use_is_422_listing_what_it_may(self, client, store, listeners):
        make_project(client, "vision", ["open"])
        for tracking, param, why in (
            ({"mlflow_server": "team"}, "tracking.mlflow_server", "project 'vision' may not use the MLflow server 'team'"),
            ({"mlflow_tracking_uri": listeners["team"].url}, "tracking.mlflow_tracking_uri",
             "this URL is the MLflow server 'team', which project 'vision' may not use"),
        ):
            response = submit(client, "vision", tracking)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_input", param)
            assert error["message"] == f"{param}: {why}; MLflow servers project 'vision' may use: open"
        assert jobs(store) == 0
        assert submit(client, "vision", {"mlflow_server": "open"}).status_code == 201
        assert submit(client, "default", {"mlflow_server": "team"}).status_code == 201  # null: all the box's

    def test_turning_a_tracker_on_without_a_server_where_the_project_lacks_the_default_is_422(self, client, store):
        make_project(client, "vision", ["open"])
        make_project(client, "sealed", [])
        response = submit(client, "vision", {"mlflow": True})
        assert response.status_code == 422
        assert response.json()["error"] == {
            "code": "invalid_input", "param": "tracking.mlflow",
            "message": "tracking.mlflow: project 'vision' may not use the box's default MLflow server 'team', and "
                       "the job names no other; name one with tracking.mlflow_server (MLflow servers project "
                       "'vision' may use: open), or set tracking.mlflow to false"}
        response = submit(client, "sealed", {"wandb": True})
        assert response.status_code == 422 and response.json()["error"]["param"] == "tracking.wandb"
        assert "project 'sealed' may use no W&B server" in response.json()["error"]["message"]
        assert jobs(store) == 0
        assert submit(client, "vision", {}).status_code == 201  # the default is not asked for: no MLflow


def test_an_openai_wandb_integration_in_a_project_without_w_and_b_is_refused(client, store) -> None:
    make_project(client, "sealed", ["team"])
    headers = {"OpenAI-Project": "sealed"}
    uploaded = client.post("/openai/v1/files", headers=headers, data={"purpose": "fine-tune"}, files={
        "file": ("t.jsonl", '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')})
    assert uploaded.status_code == 200, uploaded.text
    response = client.post("/openai/v1/fine_tuning/jobs", headers=headers, json={
        "model": "tiny", "training_file": uploaded.json()["id"],
        "integrations": [{"type": "wandb", "wandb": {"project": "sweeps"}}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "project 'sealed' may not use the box's default W&B server 'wandb'" in error["message"]
    assert "project 'sealed' may use no W&B server" in error["message"]
    assert jobs(store) == 0


class TestTheWorkerAppliesTheList:
    def test_a_server_the_project_lost_after_submission_is_a_warning_and_never_contacted(
        self, client, store, settings, listeners
    ) -> None:
        make_project(client, "vision", ["open"])
        response = submit(client, "vision", {"mlflow_server": "open"})
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        assert client.patch("/v1/projects/vision", json={"tracking_servers": []}).status_code == 200
        run_tracking(store, settings, job_id)
        assert not listeners["open"].seen and not listeners["team"].seen
        (warning,) = [e for e in events_of(client.get(f"/v1/jobs/{job_id}/events").text) if e["event"] == "log"]
        assert warning["data"]["level"] == "warning" and warning["data"]["source"] == "tracking"
        assert warning["data"]["message"].startswith(
            "tracking.mlflow_server: project 'vision' may not use the MLflow server 'open'; project 'vision' may "
            "use no MLflow server")

    def test_the_boxs_default_tracks_only_projects_that_may_use_it(self, client, store, settings, listeners) -> None:
        make_project(client, "vision", ["open"])
        in_vision = submit(client, "vision", {}).json()["id"]
        in_default = submit(client, "default", {}).json()["id"]
        run_tracking(store, settings, in_vision)
        assert not listeners["team"].seen
        assert [e for e in events_of(client.get(f"/v1/jobs/{in_vision}/events").text) if e["event"] == "log"] == []
        run_tracking(store, settings, in_default)
        assert listeners["team"].authorizations == [f"Bearer {TEAM_TOKEN}"]
