"""Jobs that span machines, end to end on one box: two real worker processes stand for two
machines, told apart by their loopback addresses (``FTQ_WORKER_ADDRESS`` 127.0.0.2 and
127.0.0.3: Linux answers all of 127/8), sharing the data directory (local mode), with a real
uvicorn API, PostgreSQL and Redis. Each worker has 2 CPU slots; ranks run on the CPU (gloo).

- a job of ``gpus: 2, nodes: 2`` runs one rank on each machine (torchrun's c10d rendezvous at the
  leader) to ``succeeded`` (that its losses match 2 ranks on one machine is proven across real
  network namespaces in ``tests/netns/test_netns_machines.py``);
- the follower machine's ranks killed mid-job end every rank of the attempt on both machines and
  the job retries from its last checkpoint (``node_lost``), no hang;
- the follower machine lost whole (its worker and ranks SIGKILLed): the job is requeued
  (``node_lost``) and runs on both machines again once that worker is back;
- specs the machines cannot hold are refused at submission, naming ``nodes``.

Separate network namespaces (the issue's CI proof) are not used here: these tests need no root.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.e2e_stacks import postgres_stack
from tests.fixtures.stack import Stack, free_port
from tests.fixtures.stack_jobs import SHORT, follow, submit, upload, wait_job
from worker.process import tagged_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEADER_ADDRESS = "127.0.0.2"
FOLLOWER_ADDRESS = "127.0.0.3"
STEPS = {**SHORT, "max_steps": 8}
LONG = {**SHORT, "max_steps": 100_000}


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """The PostgreSQL + Redis stack with two worker "machines" of 2 CPU slots each."""
    extra = {"FTQ_WORKER_ADDRESS": LEADER_ADDRESS, "FTQ_RDZV_PORT": str(free_port())}
    stacks = postgres_stack(tmp_path_factory.mktemp("machines"), model_root, extra, worker_args=("--slots", "2"))
    stack = next(stacks)
    try:
        follower_env = {**stack.env, "FTQ_WORKER_ADDRESS": FOLLOWER_ADDRESS}
        stack.start("worker-b", [sys.executable, "-m", "cli", "worker", "--name", follower_id(stack), "--slots", "2"],
                    follower_env)
        _wait_for_workers(stack, 2)
        yield stack
    finally:
        stacks.close()


def follower_id(stack: Stack) -> str:
    return f"{stack.worker_id}-b"


def _wait_for_workers(stack: Stack, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with stack.client() as client:
        while time.monotonic() < deadline:
            try:
                workers = client.get("/v1/hardware").json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                workers = []
            if len(workers) >= count and all(w["hardware"] for w in workers):
                return
            time.sleep(0.3)
    raise AssertionError(f"{count} workers did not register in {timeout_s:.0f}s\n{stack.log_tail()}")


def _finished(client: httpx.Client, job_id: str, timeout_s: float = 400) -> dict[str, Any]:
    return wait_job(client, job_id, lambda j: j["status"] not in ("queued", "running"), what="finished",
                    timeout_s=timeout_s)


def test_a_two_machine_job_succeeds_with_one_rank_on_each_machine(machines, chat_dataset: Path):
    """That its losses equal two ranks on one machine is proven once, across real network
    namespaces: ``tests/netns/test_netns_machines.py::test_a_two_machine_job_matches_two_ranks_on_one_machine``
    (a second training here would repeat it; CI is CPU-bound)."""
    stack = machines
    with stack.client() as client:
        file_id = upload(client, chat_dataset)
        spread = submit(client, file_id, hyperparameters=STEPS, gpus=2, nodes=2, name="two machines")
        events = follow(client, spread["id"], timeout_s=400)
        done = client.get(f"/v1/jobs/{spread['id']}").json()
        assert done["status"] == "succeeded", f"{done}\n{stack.log_tail()}"
        states = [data for _, kind, data in events if kind == "state"]
        assert [s["status"] for s in states] == ["queued", "running", "succeeded"]
        assert states[1]["worker_id"] == stack.worker_id, "the leader (first address) claims and reports"
        steps = [data for _, kind, data in events if kind == "step"]
        assert [s["step"] for s in steps] == list(range(1, 9))
        assert all([r["rank"] for r in s["ranks"]] == [0, 1] for s in steps), "one rank on each machine"
        assert all(math.isfinite(s["loss"]) for s in steps)
        ran = (stack.data_dir / "jobs" / spread["id"] / "trainer.node-1.stderr.log")
        assert ran.is_file(), "the follower machine ran its part"


def test_refused_at_submission_when_the_machines_cannot_hold_it(machines, chat_dataset: Path):
    with machines.client() as client:
        file_id = upload(client, chat_dataset)
        body = {"model": "tiny-llama", "training_file": file_id, "hyperparameters": STEPS}
        too_many = client.post("/v1/jobs", json={**body, "gpus": 3, "nodes": 3})
        assert too_many.status_code == 422 and "nodes" in too_many.text, too_many.text
        uneven = client.post("/v1/jobs", json={**body, "gpus": 3, "nodes": 2})
        assert uneven.status_code == 422 and "nodes" in uneven.text, uneven.text
        full = client.post("/v1/jobs", json={**body, "gpus": 2, "nodes": 2, "method": "full"})
        assert full.status_code == 422 and "nodes" in full.text and "method full" in full.text, full.text


def test_a_follower_killed_mid_job_ends_every_rank_and_the_job_retries(machines, chat_dataset: Path):
    stack = machines
    leader, follower = stack.worker_id, follower_id(stack)
    with stack.client() as client:
        job = submit(client, upload(client, chat_dataset), hyperparameters=LONG, gpus=2, nodes=2,
                     checkpoint_every=2, name="doomed follower")
        wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 3, what="training on two machines",
                 timeout_s=300)
        first = tagged_pids(f"{follower}|{job['id']}|1")
        assert first, "the follower machine runs the job's ranks"
        for pid in first:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        retried = wait_job(client, job["id"], lambda j: j["attempts"] >= 2 and j["status"] == "running",
                           what="the retry", timeout_s=180)
        assert retried["attempts"] == 2
        for host in (leader, follower):
            assert tagged_pids(f"{host}|{job['id']}|1") == [], f"a process of the killed attempt survived on {host}"
        wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 4, what="the retry training", timeout_s=300)

        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
        assert _finished(client, job["id"])["status"] == "cancelled", stack.log_tail()
        states = [data for _, kind, data in follow(client, job["id"]) if kind == "state"]
        assert [s["status"] for s in states] == ["queued", "running", "queued", "running", "cancelled"], states
        assert states[2]["error_code"] == "node_lost", states[2]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(tagged_pids(f"{h}|{job['id']}|") for h in (leader, follower)):
            time.sleep(0.2)
        for host in (leader, follower):
            assert tagged_pids(f"{host}|{job['id']}|") == [], f"a process of the job survived on {host}"


def test_a_follower_machine_lost_whole_requeues_the_job_which_resumes_when_it_returns(machines, chat_dataset: Path):
    """The follower's worker and its ranks all SIGKILLed (the machine died): the leader's ranks
    end, the job goes back to the queue (node_lost); the machine's worker starts again and the
    job runs on both machines from its last checkpoint."""
    stack = machines
    leader, follower = stack.worker_id, follower_id(stack)
    with stack.client() as client:
        job = submit(client, upload(client, chat_dataset), hyperparameters=LONG, gpus=2, nodes=2,
                     checkpoint_every=2, name="lost machine")
        wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 3, what="training on two machines",
                 timeout_s=300)
        stack.kill("worker-b")
        for pid in tagged_pids(f"{follower}|{job['id']}|"):  # its ranks run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and tagged_pids(f"{leader}|{job['id']}|1"):
            time.sleep(0.2)
        assert tagged_pids(f"{leader}|{job['id']}|1") == [], f"the leader's ranks outlived the lost machine\n{stack.log_tail()}"

        stack.restart("worker-b")
        resumed = wait_job(
            client, job["id"],
            lambda j: j["status"] == "running" and j["attempts"] >= 2 and bool(tagged_pids(f"{follower}|{job['id']}|")),
            what="the retry on both machines", timeout_s=240,
        )
        step = resumed["progress"]["step"]
        wait_job(client, job["id"], lambda j: j["progress"]["step"] > step, what="the retry training", timeout_s=300)

        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
        assert _finished(client, job["id"])["status"] == "cancelled", stack.log_tail()
        states = [data for _, kind, data in follow(client, job["id"]) if kind == "state"]
        assert states[2]["status"] == "queued" and states[2]["error_code"] == "node_lost", states
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(tagged_pids(f"{h}|{job['id']}|") for h in (leader, follower)):
            time.sleep(0.2)
        for host in (leader, follower):
            assert tagged_pids(f"{host}|{job['id']}|") == [], f"a process of the job survived on {host}"
