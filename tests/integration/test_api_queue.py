"""The API's scheduling fields on the real stores: a job's ``priority`` and ``gpus``, its ``queue``
position, ``GET /v1/queue`` in claim order."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from core.db import utcnow
from core.jobs.models import Job
from core.settings import Settings
from core.workers.models import Worker
from tests.integration.helpers import spec, upload

pytestmark = pytest.mark.integration


class TestApi:
    def test_priority_and_gpus_are_stored_and_returned(self, client: TestClient, store) -> None:
        file_id = upload(client)
        response = client.post("/v1/jobs", json=spec(file_id, priority="high"))
        assert response.status_code == 201, response.text
        job = response.json()
        assert (job["priority"], job["gpus"], job["spec"]["priority"]) == ("high", 1, "high")
        with store.sessions() as session:
            assert session.get(Job, job["id"]).priority == "high"

    def test_an_unknown_priority_is_422_naming_the_choices(self, client: TestClient) -> None:
        response = client.post("/v1/jobs", json=spec(upload(client), priority="urgent"))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "priority" and "high" in error["message"]

    def test_more_than_one_gpu_is_422_the_trainer_uses_one(self, client: TestClient) -> None:
        response = client.post("/v1/jobs", json=spec(upload(client), gpus=2))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "gpus" and "not supported yet: the trainer uses one GPU" in error["message"]

    def test_more_gpus_than_the_live_workers_report_is_422(self, client: TestClient, store) -> None:
        now = utcnow()
        with store.sessions.begin() as session:
            session.add(Worker(worker_id="box/gpu0", hostname="box", device="cuda:0", hardware={},
                               started_at=now, heartbeat_at=now))
        response = client.post("/v1/jobs", json=spec(upload(client), gpus=3))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "gpus" and "the 1 device(s) this box's live workers report" in error["message"]
        assert "box/gpu0 (cuda:0)" in error["message"]

    def test_zero_gpus_is_422(self, client: TestClient) -> None:
        response = client.post("/v1/jobs", json=spec(upload(client), gpus=0))
        assert response.status_code == 422 and response.json()["error"]["param"] == "gpus"

    def test_a_queued_job_shows_its_queue_position_and_the_queue_lists_claim_order(
        self, client: TestClient
    ) -> None:
        file_id = upload(client)
        first = client.post("/v1/jobs", json=spec(file_id, priority="low")).json()["id"]
        second = client.post("/v1/jobs", json=spec(file_id)).json()["id"]
        third = client.post("/v1/jobs", json=spec(file_id, priority="high")).json()["id"]

        job = client.get(f"/v1/jobs/{first}").json()
        assert job["queue"] == {"position": 3, "ahead": [third, second], "estimated_start_at": None}

        queue = client.get("/v1/queue").json()
        assert [(q["id"], q["position"], q["priority"]) for q in queue["data"]] == [
            (third, 1, "high"), (second, 2, "normal"), (first, 3, "low")
        ]
        assert queue["data"][0]["owner"] == "admin" and queue["live_workers"] == 0
        assert queue["running"] == []

        client.post(f"/v1/jobs/{third}/cancel")
        assert client.get(f"/v1/jobs/{third}").json()["queue"] is None
        assert client.get(f"/v1/jobs/{first}").json()["queue"]["position"] == 2

    def test_the_queue_needs_a_key(self, settings: Settings, client: TestClient) -> None:
        response = client.get("/v1/queue", headers={"Authorization": ""})
        assert response.status_code == 401
