"""The API's scheduling fields on the real stores: a job's ``priority`` and ``gpus``, its ``queue``
position, ``GET /v1/queue`` in claim order."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import update
from fastapi.testclient import TestClient

from core.db import utcnow
from core.jobs.models import Checkpoint, Job, JobNode
from core.settings import Settings
from core.users.models import User
from core.workers.models import GpuSlot, Worker
from tests.integration.helpers import spec, upload

pytestmark = pytest.mark.integration


def add_host(store, name: str, gpus: int, *, live: bool = True) -> None:
    """A worker host with ``gpus`` GPUs (its ``gpu_slot`` rows), live or long silent."""
    now = utcnow()
    beat = now if live else now - dt.timedelta(hours=1)
    with store.sessions.begin() as session:
        session.add(Worker(worker_id=name, hostname=name, device="cuda", hardware={}, started_at=now, heartbeat_at=beat))
        session.flush()
        session.add_all(GpuSlot(worker_id=name, slot=i, device=str(i)) for i in range(gpus))


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

    def test_a_multi_gpu_job_up_to_the_largest_live_host_is_accepted(self, client: TestClient, store) -> None:
        add_host(store, "box", 2)
        response = client.post("/v1/jobs", json=spec(upload(client), gpus=2))
        assert response.status_code == 201, response.text
        assert response.json()["gpus"] == 2 and response.json()["spec"]["gpus"] == 2

    def test_more_gpus_than_any_live_host_has_is_422_naming_the_hosts(self, client: TestClient, store) -> None:
        add_host(store, "box-a", 1)
        add_host(store, "box-b", 2)
        add_host(store, "gone", 8, live=False)
        response = client.post("/v1/jobs", json=spec(upload(client), gpus=3))
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["param"] == "gpus" and "more than any live worker host has" in error["message"]
        assert "box-a (1 GPU), box-b (2 GPUs)" in error["message"] and "gone" not in error["message"]

    def test_more_gpus_than_the_users_cap_is_422(self, client: TestClient, store) -> None:
        add_host(store, "box", 4)
        with store.sessions.begin() as session:
            session.execute(update(User).where(User.name == "admin").values(max_running_jobs=1))
        response = client.post("/v1/jobs", json=spec(upload(client), gpus=2))
        assert response.status_code == 422
        assert "cap of 1 running GPUs" in response.json()["error"]["message"]

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
        assert job["queue"] == {"position": 3, "ahead": [third, second], "estimated_start_at": None, "holds": None,
                                "decided_by": None, "waits_for": None}

        queue = client.get("/v1/queue").json()
        assert [(q["id"], q["position"], q["priority"]) for q in queue["data"]] == [
            (third, 1, "high"), (second, 2, "normal"), (first, 3, "low")
        ]
        assert queue["data"][0]["owner"] == "admin" and (queue["live_workers"], queue["live_gpus"]) == (0, 0)
        assert queue["running"] == []

        client.post(f"/v1/jobs/{third}/cancel")
        assert client.get(f"/v1/jobs/{third}").json()["queue"] is None
        assert client.get(f"/v1/jobs/{first}").json()["queue"]["position"] == 2

    def test_the_queue_needs_a_key(self, settings: Settings, client: TestClient) -> None:
        response = client.get("/v1/queue", headers={"Authorization": ""})
        assert response.status_code == 401


class TestGpusShown:
    def test_a_running_job_shows_the_gpus_it_holds_in_the_job_the_list_the_queue_and_the_host(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        add_host(store, "box", 3)
        file_id = upload(client)
        job = client.post("/v1/jobs", json=spec(file_id, gpus=2)).json()
        claim(store, settings, job["id"], "box", (0, 2))

        shown = client.get(f"/v1/jobs/{job['id']}").json()
        assert shown["gpus"] == 2 and shown["held_gpus"] == [
            {"worker": "box", "slot": 0, "device": "0"}, {"worker": "box", "slot": 2, "device": "2"}]
        [listed] = client.get("/v1/jobs").json()["data"]
        assert listed["held_gpus"] == shown["held_gpus"]
        [running] = client.get("/v1/queue").json()["running"]
        assert (running["gpus"], running["held_gpus"]) == (2, shown["held_gpus"])
        [worker] = client.get("/v1/hardware").json()["data"]
        assert [(g["slot"], g["device"], g["job"]) for g in worker["gpus"]] == [
            (0, "0", job["id"]), (1, "1", None), (2, "2", job["id"])]

    def test_the_head_of_the_queue_shows_the_host_it_holds(self, client: TestClient, store, settings: Settings) -> None:
        add_host(store, "box", 2)
        file_id = upload(client)
        first = client.post("/v1/jobs", json=spec(file_id)).json()
        claim(store, settings, first["id"], "box", (0,))
        head = client.post("/v1/jobs", json=spec(file_id, gpus=2)).json()
        queue = client.get("/v1/queue").json()
        assert [(q["id"], q["holds"]) for q in queue["data"]] == [(head["id"], "box")]
        assert queue["live_gpus"] == 2
        assert client.get(f"/v1/jobs/{head['id']}").json()["queue"]["holds"] == "box"

    def test_a_retry_whose_checkpoint_is_in_a_shared_storage_no_live_worker_mounts_says_it_waits_for_one(
        self, client: TestClient, store
    ) -> None:
        add_host(store, "box-free", 2)  # free GPUs, no shared storage: the retry cannot resume there
        job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
        shared = "/mnt/ckpt"
        with store.sessions.begin() as session:
            session.execute(update(Job).where(Job.job_id == job_id).values(gpus=2, nodes=2, method="full", attempts=1))
            for rank, name in enumerate(("box-a", "box-b")):  # its first attempt's machines, gone since
                session.add(Worker(worker_id=name, hostname=name, device="cuda", hardware={}, shared_dir=shared,
                                   shared_id="stor-1", heartbeat_at=utcnow() - dt.timedelta(hours=1)))
                session.flush()
                session.add(GpuSlot(worker_id=name, slot=0, device="0"))
                session.add(JobNode(job_id=job_id, attempt=1, node_rank=rank, worker_id=name, address=f"10.0.0.{rank}",
                                    rdzv_endpoint="10.0.0.0:29400"))
            session.add(Checkpoint(job_id=job_id, step=6, path=f"{shared}/jobs/{job_id}/checkpoints/step-000006",
                                   bytes=1))
        reason = (f"waits for a live worker mounting the shared storage stor-1 at {shared} (FTQ_SHARED_DIR), which "
                  f"holds its checkpoint step 6 in {shared}/jobs/{job_id} (never uploaded): no live worker mounts "
                  "it now")
        [queued] = client.get("/v1/queue").json()["data"]
        assert (queued["id"], queued["waits_for"], queued["estimated_start_at"]) == (job_id, reason, None)
        assert client.get(f"/v1/jobs/{job_id}").json()["queue"]["waits_for"] == reason
        # Another project's member sees the job by its project alone: the reason names its directory.
        from core.projects.service import create_project
        from core.users.service import create_user_with_key

        with store.sessions.begin() as session:
            create_project(session, "elsewhere")
            _user, issued = create_user_with_key(session, "carol", project_names=["elsewhere"])
        [theirs] = client.get("/v1/queue", headers={"Authorization": f"Bearer {issued.secret}"}).json()["data"]
        assert (theirs["id"], theirs["waits_for"]) == (None, None), theirs

        with store.sessions.begin() as session:  # a machine of that storage is live again: it may start there
            session.execute(update(Worker).where(Worker.worker_id == "box-a").values(heartbeat_at=utcnow()))
        [queued] = client.get("/v1/queue").json()["data"]
        assert queued["waits_for"] is None


def claim(store, settings: Settings, job_id: str, host: str, slots: tuple[int, ...]) -> None:
    from core.jobs import scheduling
    from core.jobs.placement import Placement

    with store.sessions() as session:
        assert scheduling.try_claim(session, Placement(job_id, host, slots), settings)
        session.commit()
