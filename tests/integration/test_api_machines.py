"""Machines on the real stores (PostgreSQL and SQLite): ``GET /v1/hardware`` groups the worker
hosts by machine (hostname and address) with each machine's status, GPUs and the jobs holding
them; a machine that stops heartbeating is ``lost``, and the reaper requeues its running jobs (or
fails them once their attempts are spent), freeing its GPUs, while the live machine's job runs on."""

from __future__ import annotations

import datetime as dt

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from core.db import utcnow
from core.jobs import scheduling
from core.jobs.models import Job
from core.jobs.placement import Placement
from core.settings import Settings
from core.workers.models import GpuSlot, Worker, WorkerKey
from tests.fixtures.scheduling import add_job
from worker.reaper import reap

pytestmark = pytest.mark.integration

STALE = dt.timedelta(minutes=10)


def add_machine(store, worker_id: str, hostname: str, *, slots: int, beat_ago: dt.timedelta = dt.timedelta(0),
                address: str | None = None, key_id: str | None = None) -> None:
    """A worker host's row and its GPU pool, as ``presence.register`` writes them."""
    now = utcnow()
    with store.sessions.begin() as session:
        session.add(Worker(worker_id=worker_id, hostname=hostname, device=f"cuda:{','.join(map(str, range(slots)))}",
                           hardware={}, started_at=now - STALE * 2, heartbeat_at=now - beat_ago,
                           address=address, key_id=key_id))
        session.flush()
        session.add_all(GpuSlot(worker_id=worker_id, slot=i, device=str(i)) for i in range(slots))


def add_worker_key(store, name: str) -> str:
    key_id = f"wkey-{name}"
    with store.sessions.begin() as session:
        session.add(WorkerKey(worker_key_id=key_id, name=name, prefix=name[:16], key_hash="0" * 64))
    return key_id


def run_on(store, settings: Settings, worker_id: str, slots: tuple[int, ...], *, attempts: int,
           beat_ago: dt.timedelta = dt.timedelta(0)) -> str:
    """A job claimed on ``slots`` of ``worker_id``, its own heartbeat ``beat_ago`` old."""
    job_id = add_job(store, gpus=len(slots))
    with store.sessions() as session:
        values = {"worker_id": worker_id, "attempts": attempts, "heartbeat_at": utcnow() - beat_ago}
        assert scheduling.try_claim(session, Placement(job_id, worker_id, slots), settings, values=values)
        session.commit()
    return job_id


def job_row(store, job_id: str) -> Job:
    with store.sessions() as session:
        return session.get(Job, job_id)


def held(store, worker_id: str) -> list[str | None]:
    with store.sessions() as session:
        return list(session.scalars(select(GpuSlot.job_id).where(GpuSlot.worker_id == worker_id).order_by(GpuSlot.slot)))


class TestHardwareByMachine:
    def test_workers_are_grouped_by_hostname_and_address_with_status_gpus_and_jobs(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        key = add_worker_key(store, "box-b")
        add_machine(store, "box-a/gpu0", "box-a", slots=1, address="10.0.0.1")
        add_machine(store, "box-a/gpu1", "box-a", slots=1, address="10.0.0.1", beat_ago=STALE)
        add_machine(store, "box-b", "box-b", slots=2, address="10.0.0.2", key_id=key, beat_ago=STALE)
        job = run_on(store, settings, "box-b", (1,), attempts=1)

        body = client.get("/v1/hardware").json()

        machines = {m["name"]: m for m in body["machines"]}
        assert list(machines) == ["box-a", "box-b"]
        a, b = machines["box-a"], machines["box-b"]
        assert (a["address"], a["status"], a["remote"], a["workers"]) == ("10.0.0.1", "live", False,
                                                                          ["box-a/gpu0", "box-a/gpu1"])
        assert a["heartbeat_age_s"] < 60 and a["jobs"] == []
        assert (b["address"], b["status"], b["remote"], b["workers"]) == ("10.0.0.2", "lost", True, ["box-b"])
        assert b["heartbeat_age_s"] >= 599
        assert [(g["worker"], g["slot"], g["job"]) for g in b["gpus"]] == [("box-b", 0, None), ("box-b", 1, job)]
        assert b["jobs"] == [job]
        workers = {w["id"]: w for w in body["data"]}
        assert (workers["box-b"]["machine"], workers["box-b"]["remote"], workers["box-b"]["alive"]) == ("box-b", True, False)
        assert (workers["box-a/gpu0"]["address"], workers["box-a/gpu0"]["remote"]) == ("10.0.0.1", False)

    def test_one_hostname_at_two_addresses_is_two_machines(self, client: TestClient, store) -> None:
        add_machine(store, "w1", "gpu", slots=1, address="10.0.0.1")
        add_machine(store, "w2", "gpu", slots=1, address="10.0.0.2")

        machines = client.get("/v1/hardware").json()["machines"]

        assert [(m["name"], m["address"], m["workers"]) for m in machines] == [
            ("gpu", "10.0.0.1", ["w1"]),
            ("gpu", "10.0.0.2", ["w2"]),
        ]


class TestLostMachine:
    """Two machines, one of which stopped heartbeating (its worker and the jobs it ran)."""

    def test_its_jobs_are_requeued_or_failed_and_its_gpus_freed_the_live_ones_left_alone(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        settings = settings.model_copy(update={"max_attempts": 2})
        add_machine(store, "live", "box-a", slots=1)
        add_machine(store, "gone", "box-b", slots=2, beat_ago=STALE)
        kept = run_on(store, settings, "live", (0,), attempts=1)
        retried = run_on(store, settings, "gone", (0,), attempts=1, beat_ago=STALE)
        spent = run_on(store, settings, "gone", (1,), attempts=2, beat_ago=STALE)
        assert [m["status"] for m in client.get("/v1/hardware").json()["machines"]] == ["live", "lost"]
        sent: list[tuple[str, str | None]] = []

        report = reap(store.sessions, settings, enqueue=lambda job_id, host: sent.append((job_id, host)))

        assert (report.requeued, report.failed) == ([retried], [spent])
        again = job_row(store, retried)
        assert (again.status, again.worker_id, again.heartbeat_at) == ("queued", None, None)
        failed = job_row(store, spent)
        assert (failed.status, failed.error_code) == ("failed", "worker_lost")
        assert "lost worker gone" in failed.error_message and "gave up after 2 attempts" in failed.error_message
        assert job_row(store, kept).status == "running"
        assert held(store, "gone") == [None, None]
        assert held(store, "live") == [kept]
        # The requeued job's message goes out; no live machine has a free GPU, so nowhere in particular.
        assert sent == [(retried, None)]
        lost = client.get("/v1/hardware").json()["machines"][1]
        assert (lost["status"], lost["jobs"]) == ("lost", [])
