"""The GPUs page by machine, in headless Chromium: one section per machine with its status, a
machine that stopped heartbeating shown ``lost`` with what happens to its jobs, and its GPUs
freed once the reaper has requeued the job that held them.

Two machines are written into the stack's store as their workers register (``worker`` +
``gpu_slot`` rows): ``box-remote`` (a remote worker with a worker key, beating) and ``box-lost``
(silent for ten minutes), and a 2-GPU job's claim on ``box-lost``'s GPUs. The stack's own CPU
worker cannot run a 2-GPU job, so nothing but the test moves it. The rows are removed afterwards."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import GIB, screenshot_dir, submit_job

pytestmark = [pytest.mark.integration, pytest.mark.browser]

REMOTE, LOST = "box-remote", "box-lost"


@pytest.fixture
def machines(store: Any) -> Iterator[None]:
    """``box-remote``: 2 GPUs, a worker key, heartbeat set ahead (live for the test);
    ``box-lost``: 2 GPUs, last heartbeat ten minutes ago."""
    from sqlalchemy import delete

    from core.db import utcnow
    from core.workers.models import GpuSlot, Worker, WorkerKey

    now = utcnow()
    hardware = {"hardware": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "gpu_memory": 80 * GIB}}
    beats = {REMOTE: now + dt.timedelta(minutes=10), LOST: now - dt.timedelta(minutes=10)}
    addresses = {REMOTE: "10.0.0.7", LOST: "10.0.0.8"}
    with store.begin() as session:
        session.add(WorkerKey(worker_key_id="wkey-remote", name="box-remote", prefix="remote", key_hash="0" * 64))
        session.flush()
        for name, beat in beats.items():
            session.add(Worker(worker_id=name, hostname=name, device="cuda:0,1", hardware=hardware, started_at=now,
                               heartbeat_at=beat, address=addresses[name],
                               key_id="wkey-remote" if name == REMOTE else None))
            session.flush()
            session.add_all(GpuSlot(worker_id=name, slot=i, device=str(i)) for i in range(2))
    try:
        yield
    finally:
        with store.begin() as session:
            session.execute(delete(GpuSlot).where(GpuSlot.worker_id.in_(beats)))
            session.execute(delete(Worker).where(Worker.worker_id.in_(beats)))
            session.execute(delete(WorkerKey).where(WorkerKey.worker_key_id == "wkey-remote"))


def claim_on_lost_machine(store: Any, job_id: str, heartbeat_at: dt.datetime) -> None:
    from core.jobs import scheduling
    from core.jobs.placement import Placement
    from core.settings import Settings

    with store() as session:
        values = {"worker_id": LOST, "attempts": 1, "heartbeat_at": heartbeat_at}
        assert scheduling.try_claim(session, Placement(job_id, LOST, (0, 1)), Settings(), values=values)
        session.commit()


def test_a_lost_machine_is_shown_lost_with_its_job_until_the_reaper_requeues_it_and_frees_its_gpus(
    page: Any, api: httpx.Client, chat_file: Path, store: Any, machines: None, no_leftover_jobs: None
) -> None:
    from sqlalchemy import select, update

    from core.db import utcnow
    from core.jobs.models import Job, JobEvent
    from core.settings import Settings
    from worker.reaper import reap

    job = submit_job(api, chat_file, max_steps=10, name="on-lost-box", gpus=2)
    # The job's own heartbeat is still fresh: the machine went silent moments before it.
    claim_on_lost_machine(store, job["id"], utcnow() + dt.timedelta(minutes=10))

    page.goto("/#/gpus")
    lost = page.locator(f"[data-testid=machine][data-machine={LOST}]")
    lost.get_by_test_id("gpu-slot").nth(1).wait_for()
    assert lost.get_attribute("data-status") == "lost"
    assert lost.get_by_test_id("machine-status").inner_text() == "lost"
    assert "requeued to resume from their last checkpoint" in lost.get_by_test_id("machine-lost").inner_text()
    assert [s.get_attribute("data-job-id") for s in lost.get_by_test_id("gpu-slot").all()] == [job["id"], job["id"]]
    remote = page.locator(f"[data-testid=machine][data-machine={REMOTE}]")
    assert remote.get_attribute("data-status") == "live"
    assert remote.get_by_test_id("machine-facts").inner_text().startswith("10.0.0.7 · remote (worker key) · 2 GPUs")
    assert remote.get_by_test_id("machine-lost").count() == 0
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-gpus-machines.png"), full_page=True)

    # Its heartbeat ages past FTQ_HEARTBEAT_TIMEOUT_S too: the reaper (the stack's worker's, or this
    # one, whichever comes first) requeues it and frees the lost machine's GPUs.
    with store.begin() as session:
        session.execute(update(Job).where(Job.job_id == job["id"]).values(heartbeat_at=utcnow() - dt.timedelta(minutes=10)))
    reap(store, Settings(heartbeat_timeout_s=30), enqueue=lambda job_id, host: None)
    page.locator(f"[data-testid=machine][data-machine={LOST}] [data-testid=gpu-slot][data-job-id='']").nth(1).wait_for()
    assert api.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
    with store() as session:
        last = session.scalars(select(JobEvent).where(JobEvent.job_id == job["id"]).order_by(JobEvent.seq.desc())).first()
    assert "retrying from the last checkpoint after lost worker box-lost" in last.data["reason"]
