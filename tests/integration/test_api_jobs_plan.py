"""POST /v1/jobs refuses an optimization forced ``on`` that no live worker can honour (issue 3).

The workers' ``hardware`` column holds real ``python -m trainer detect --json`` output from this
(CPU) machine, as ``worker.presence`` stores it; a GPU worker's report is that output with the
capabilities a GPU build would give.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.db import utcnow
from core.jobs.models import Job
from core.workers.models import Worker
from tests.conftest import CHAT_RECORD

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def upload(client: TestClient) -> str:
    response = client.post(
        "/v1/files", files={"file": ("d.jsonl", json.dumps(CHAT_RECORD) + "\n")}, data={"purpose": "train"}
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def spec(training_file: str, **overrides: Any) -> dict[str, Any]:
    return {"model": "tiny", "training_file": training_file, "hyperparameters": {"max_steps": 3}, **overrides}


def count(store, model) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


@pytest.fixture(scope="module")
def cpu_report() -> dict[str, Any]:
    """What a CPU worker stores: the trainer's own ``detect --json``."""
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "detect", "--json", "--device", "cpu"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return json.loads(done.stdout)


def add_worker(store, worker_id: str, hardware: dict[str, Any], age_s: float = 0.0) -> None:
    with store.sessions.begin() as session:
        session.add(
            Worker(
                worker_id=worker_id,
                hostname="box",
                device="cpu",
                hardware=hardware,
                current_job_id=None,
                started_at=utcnow(),
                heartbeat_at=utcnow() - dt.timedelta(seconds=age_s),
            )
        )


def optimizations(**switches: str) -> dict[str, Any]:
    return {"optimizations": switches}


class TestForcedOnAtSubmission:
    def test_cpu_report_says_what_can_be_on(self, cpu_report) -> None:
        caps = cpu_report["capabilities"]
        assert caps["packed_metadata_cache"] is None
        assert "CUDA GPU" in caps["double_buffered_reload"]

    def test_on_that_no_live_worker_can_honour_is_422_naming_worker_reason_and_fix(
        self, client: TestClient, store, cpu_report
    ) -> None:
        add_worker(store, "box-cpu", cpu_report)
        body = spec(upload(client), **optimizations(double_buffered_reload="on"))
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported"
        assert error["param"] == "optimizations.double_buffered_reload"
        assert "worker box-cpu: offloading activations needs a CUDA GPU" in error["message"]
        assert "Set optimizations.double_buffered_reload to auto or off" in error["message"]
        assert count(store, Job) == 0

    def test_on_that_a_live_worker_can_honour_is_accepted(
        self, client: TestClient, store, cpu_report
    ) -> None:
        add_worker(store, "box-cpu", cpu_report)
        file_id = upload(client)
        response = client.post("/v1/jobs", json=spec(file_id, **optimizations(packed_metadata_cache="on")))
        assert response.status_code == 201, response.text
        # One GPU worker able to offload is enough, whatever the CPU worker says.
        gpu_report = {
            **cpu_report,
            "capabilities": {**cpu_report["capabilities"], "double_buffered_reload": None},
        }
        add_worker(store, "box-gpu0", gpu_report)
        response = client.post("/v1/jobs", json=spec(file_id, **optimizations(double_buffered_reload="on")))
        assert response.status_code == 201, response.text

    def test_without_a_live_reporting_worker_the_job_is_accepted_and_waits(
        self, client: TestClient, store, cpu_report
    ) -> None:
        file_id = upload(client)
        forced = optimizations(double_buffered_reload="on")
        assert client.post("/v1/jobs", json=spec(file_id, **forced)).status_code == 201
        # A worker whose heartbeat stopped, or one whose detect failed, does not count.
        add_worker(store, "box-dead", cpu_report, age_s=3600)
        add_worker(store, "box-broken", {"error": "python -m trainer detect --json exited with 1"})
        response = client.post("/v1/jobs", json=spec(file_id, **forced))
        assert response.status_code == 201, response.text
        assert count(store, Job) == 2

    def test_auto_and_off_are_never_refused(self, client: TestClient, store, cpu_report) -> None:
        add_worker(store, "box-cpu", cpu_report)
        body = spec(
            upload(client),
            **optimizations(double_buffered_reload="auto", moe_grouped_routing="off"),
        )
        assert client.post("/v1/jobs", json=body).status_code == 201
