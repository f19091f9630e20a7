"""A worker killed mid-job (SIGKILL, as the OOM killer or a power cut would): the job does not
stay ``running``; the next worker's reaper puts it back in the queue and it finishes from its
last checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HYPER = {"max_steps": 40, "batch_tokens": 512, "max_seq_len": 128, "learning_rate": 0.01}


def _upload(client, path: Path) -> str:
    with path.open("rb") as f:
        response = client.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "train"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _wait(client, job_id: str, predicate, what: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    job: dict = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if predicate(job):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} never became {what}; last seen {json.dumps(job)[:2000]}")


def test_a_job_whose_worker_died_is_retried_from_its_last_checkpoint(fast_reaping_stack, chat_dataset):
    stack = fast_reaping_stack
    with stack.client() as client:
        body = {"model": stack.model, "training_file": _upload(client, chat_dataset), "hyperparameters": HYPER,
                "checkpoint_every": 5}
        job = client.post("/v1/jobs", json=body).json()
        _wait(client, job["id"], lambda j: j["progress"]["step"] >= 12, "past its second checkpoint")

        stack.kill("worker")
        time.sleep(5)  # past the heartbeat timeout: nobody is left to beat it
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
        stack.restart("worker")

        done = _wait(client, job["id"], lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
                     "finished", timeout_s=240)
        assert done["status"] == "succeeded", f"{done}\n{stack.log_tail()}"
        assert done["attempts"] == 2

        events = client.get(f"/v1/jobs/{job['id']}/events").text
        assert "retrying from the last checkpoint after lost worker" in events
        plans = [json.loads(line.removeprefix("data: ")) for block in events.split("\n\n")
                 if "event: plan" in block for line in block.splitlines() if line.startswith("data: ")]
        assert len(plans) == 2 and plans[1]["resumed_from_step"] >= 10, plans[1].get("resumed_from_step")
        rows = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 100}).json()["data"]
        assert [r["step"] for r in rows] == list(range(1, 41))
