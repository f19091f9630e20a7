"""POST /v1/jobs refuses an optimization forced ``on`` that no live worker can honour (issue 3),
and ``method: qlora`` unless a live worker reports a CUDA GPU with bitsandbytes.

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
from core.jobs.models import Job, JobEvent
from core.workers.models import Worker
from tests.helpers import CHAT_RECORD

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

    def test_offload_activations_is_a_switch_of_the_job_api_too(
        self, client: TestClient, store, cpu_report
    ) -> None:
        add_worker(store, "box-cpu", cpu_report)
        file_id = upload(client)
        response = client.post("/v1/jobs", json=spec(file_id, **optimizations(offload_activations="on")))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == "optimizations.offload_activations"
        assert "worker box-cpu: offloading activations needs a CUDA GPU" in error["message"]
        response = client.post("/v1/jobs", json=spec(file_id, **optimizations(offload_activations="off")))
        assert response.status_code == 201, response.text
        assert response.json()["spec"]["optimizations"]["offload_activations"] == "off"

    def test_auto_and_off_are_never_refused(self, client: TestClient, store, cpu_report) -> None:
        add_worker(store, "box-cpu", cpu_report)
        body = spec(
            upload(client),
            **optimizations(double_buffered_reload="auto", moe_grouped_routing="off"),
        )
        assert client.post("/v1/jobs", json=body).status_code == 201


def cuda_report(cpu_report: dict[str, Any], *, bitsandbytes: bool) -> dict[str, Any]:
    """A GPU worker's report: this machine's with the device fields a CUDA build gives."""
    hardware = {**cpu_report["hardware"], "device": "cuda", "name": "NVIDIA H200", "capability": [9, 0]}
    return {**cpu_report, "hardware": {**hardware, "bitsandbytes": bitsandbytes}}


class TestQloraAtSubmission:
    def test_a_workers_report_says_its_device_and_bitsandbytes(self, cpu_report) -> None:
        # The two fields the API reads (core.jobs.admission._qlora_gap).
        assert cpu_report["hardware"]["device"] == "cpu"
        assert isinstance(cpu_report["hardware"]["bitsandbytes"], bool)

    def test_refusal_names_each_live_worker_what_it_lacks_and_the_fix(
        self, client: TestClient, store, cpu_report
    ) -> None:
        add_worker(store, "box-cpu", cpu_report)
        add_worker(store, "box-gpu0", cuda_report(cpu_report, bitsandbytes=False))
        add_worker(store, "box-gpu1", {})  # registered, its detect not finished yet
        older = cuda_report(cpu_report, bitsandbytes=True)
        del older["hardware"]["bitsandbytes"]
        add_worker(store, "box-gpu2", older)  # a trainer that does not report bitsandbytes
        file_id = upload(client)
        response = client.post("/v1/jobs", json=spec(file_id, method="qlora"))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported", "method")
        message = error["message"]
        assert "no live worker has both" in message
        assert "worker box-cpu: " in message and "(cpu) without CUDA" in message
        assert "worker box-gpu0: NVIDIA H200 (cuda) without bitsandbytes;" in message
        assert "worker box-gpu1: no hardware report" in message
        assert "worker box-gpu2: NVIDIA H200 (cuda) without bitsandbytes)" in message
        assert "Use method lora, or install bitsandbytes on a GPU worker (pip install 'ftq[qlora]')" in message
        assert (count(store, Job), count(store, JobEvent)) == (0, 0)
        assert client.post("/v1/jobs", json=spec(file_id, method="lora")).status_code == 201

    def test_a_live_cuda_worker_with_bitsandbytes_accepts_qlora(
        self, client: TestClient, store, cpu_report
    ) -> None:
        add_worker(store, "box-cpu", cpu_report)
        add_worker(store, "box-gpu0", cuda_report(cpu_report, bitsandbytes=True))
        response = client.post("/v1/jobs", json=spec(upload(client), method="qlora"))
        assert response.status_code == 201, response.text
        job = response.json()
        assert (job["status"], job["spec"]["method"]) == ("queued", "qlora")
        assert count(store, Job) == 1

    def test_a_cuda_worker_with_bitsandbytes_counts_only_while_live(
        self, client: TestClient, store, cpu_report
    ) -> None:
        add_worker(store, "box-gpu0", cuda_report(cpu_report, bitsandbytes=True), age_s=3600)
        response = client.post("/v1/jobs", json=spec(upload(client), method="qlora"))
        assert response.status_code == 422, response.text
        assert "no worker is live" in response.json()["error"]["message"]
        assert count(store, Job) == 0
