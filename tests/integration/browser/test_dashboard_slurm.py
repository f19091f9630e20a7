"""A Slurm pool on the GPUs page, in headless Chromium: the bridge's card shows the partition as
Slurm reports it (nodes and GPUs idle/allocated, each ftq job in Slurm's queue with its state and
pending reason, linked to its page), and a job queued for the pool reads "Slurm decides" where an
ordinary job shows its estimated start.

No Slurm runs here (``tests/integration/e2e/test_slurm_e2e.py`` drives a real one): a bridge's
``worker`` row (``pool: slurm``, its report in ``hardware``, as ``ftq slurm-bridge`` writes it
at each heartbeat) and its slots are written into the stack's store; one pooled job is claimed onto
them as the bridge's claim would, a second stays queued. All of it is removed afterwards."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import cancel_in_store, live_host, screenshot_dir, submit_job

pytestmark = [pytest.mark.integration, pytest.mark.browser]

BRIDGE = "slurm-bridge-test"


def _report(pending_job: str | None) -> dict[str, Any]:
    jobs = [{"job_id": pending_job, "slurm_job_id": "4242", "state": "PENDING", "reason": "Resources"}] if pending_job else []
    return {"pool": {"kind": "slurm", "name": "slurm", "partition": "gpu", "nodes": 2, "per_node": 2, "unit": "gpu",
                     "account": "lab", "qos": "normal",
                     "cluster": {"nodes": {"idle": 1, "allocated": 1, "other": 0},
                                 "cpus": {"idle": 64, "allocated": 64, "total": 128},
                                 "gpus": {"idle": 2, "allocated": 2, "total": 4}, "jobs": jobs},
                     "observed_at": "2026-11-28T04:00:00Z"}}


@pytest.fixture
def bridge_row(store: Any) -> Iterator[str]:
    with live_host(store, BRIDGE, 4, hostname="login1", device="cpu", pool="slurm", hardware=_report(None)) as host:
        yield host


def _claim_on_bridge(store: Any, job_id: str) -> None:
    """The bridge's claim of ``job_id`` (2 of its slots) and Slurm's report naming it pending."""
    from sqlalchemy import update

    from core.db import utcnow
    from core.jobs import scheduling
    from core.jobs.placement import Placement
    from core.settings import Settings
    from core.workers.models import Worker

    with store() as session:
        assert scheduling.try_claim(session, Placement(job_id, BRIDGE, (0, 1)), Settings(max_running_jobs_per_user=0),
                                    values={"worker_id": BRIDGE, "attempts": 1,
                                            "heartbeat_at": utcnow() + dt.timedelta(minutes=10)})
        session.execute(update(Worker).where(Worker.worker_id == BRIDGE).values(hardware=_report(job_id)))
        session.commit()


def test_the_gpus_page_shows_the_slurm_pool_and_slurm_decides_for_its_queue(
    page: Any, api: httpx.Client, store: Any, chat_file: Path, bridge_row: str, no_leftover_jobs: None
) -> None:
    pending = submit_job(api, chat_file, 5, "waits in Slurm", pool="slurm", gpus=2, nodes=2)
    _claim_on_bridge(store, pending["id"])
    queued = submit_job(api, chat_file, 5, "queued for Slurm", pool="slurm", gpus=4, nodes=2)
    try:
        page.goto("/#/gpus")
        pool = page.get_by_test_id("slurm-pool")
        pool.wait_for(timeout=30_000)
        assert "Slurm partition gpu · 2 nodes × 2 GPUs" in pool.inner_text()
        assert page.get_by_text('Slurm pool "slurm" · 4 GPUs').is_visible()
        assert page.get_by_test_id("slurm-nodes").inner_text() == "Nodes: 1 idle, 1 allocated"
        assert page.get_by_test_id("slurm-gpus").inner_text() == "GPUs: 2 idle, 2 allocated"
        job = page.locator(f'[data-testid="slurm-job"][data-job-id="{pending["id"]}"]')
        assert "Slurm job 4242: PENDING (Resources)" in job.inner_text()
        assert job.locator("a").get_attribute("href") == f"#/jobs/{pending['id']}"
        row = page.locator("tr", has_text=queued["id"]).or_(page.locator("tr", has_text="queued for Slurm")).first
        assert row.get_by_test_id("queue-eta").inner_text() == "Slurm decides"
        assert "Estimates assume 1 live worker host with 1 GPU." in page.get_by_test_id("queue-rules").inner_text()
        if shots := screenshot_dir():
            page.screenshot(path=str(shots / "dashboard-gpus-slurm.png"), full_page=True)
    finally:
        cancel_in_store(store, pending["id"])
