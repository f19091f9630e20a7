"""Jobs on the Slurm pool, end to end against a real Slurm (scripts/slurm.sh: slurmctld and two
slurmd nodes on 127.0.0.1), a real uvicorn API, PostgreSQL and Redis; the only worker is
``ftq slurm-bridge`` (tests/fixtures/slurm.py). Ranks run on the nodes' CPUs.

- a job with ``pool: slurm`` goes through sbatch/srun to ``succeeded``, its steps and events in
  the store, Slurm's states on its page;
- a job spread over both Slurm nodes (``nodes: 2``: srun starts a torchrun on each, c10d
  rendezvous at the first node) succeeds with one rank per node;
- a cancel stops the running trainer at a checkpoint (``scancel --signal=TERM``): ``cancelled``;
- a job paused (cancelled at a checkpoint) is resumed through the API, which mounts the cluster's
  shared directory (FTQ_SHARED_DIR): the new job starts at the checkpoint's step + 1 and succeeds;
- the trainer killed inside its srun step: the attempt fails in Slurm, the bridge resubmits, the
  trainer resumes from its checkpoint and every step is recorded once;
- a job larger than the partition is refused at submission (422 naming the limit);
- two ranks under torchrun whose checkpoint on Slurm's TERM takes 35 s are not killed by
  torchrun 30 s after it: the checkpoint is written and the next attempt resumes after it;
- the bridge's ``--environment`` sources a profile script that reads an unset variable (as sites'
  do) and every job runs; a pause while it still runs (before the srun step exists) reaches the
  trainer once it started, and every step it trained is in a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.processes import pids_where
from tests.fixtures.slurm import Cluster, slurm_stack
from tests.fixtures.stack import Stack
from tests.fixtures.stack_jobs import SHORT, follow, submit, upload, wait_job
from trainer.training import layout

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = {**SHORT, "max_steps": 6}
LONG = {**SHORT, "max_steps": 100_000}
KILLED_STEPS = 120


PROFILE = """# as sites' profile scripts (modules.sh, conda) do: read a variable that may be unset
if [ -n "$FTQ_TEST_NEVER_SET" ]; then echo "never" >&2; fi
echo "ftq-test profile: loaded" >&2
"""
HOLD = "hold-environment"
"""While this file is in the shared directory, the bridge's --environment waits (a slow module load)."""
SLOW_STOP = "slow-stop-checkpoint"
"""A job submitted while this file is in the shared directory takes its seconds to write the
checkpoint a stop asks for (the trainer's test-only FTQ_TEST_STOP_CHECKPOINT_DELAY_S)."""
SLOW_STOP_S = 35
"""Longer than torchrun's own 30 s between forwarding a TERM and SIGKILLing its ranks, shorter
than the stack's FTQ_CANCEL_GRACE_S (60)."""


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory, model_root: Path, slurm_cluster: Cluster) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("slurm")
    (base / "profile.sh").write_text(PROFILE)
    environment = (f"source {base}/profile.sh\nwhile [ -e {base}/{HOLD} ]; do sleep 0.2; done\n"
                   f"if [ -e {base}/{SLOW_STOP} ]; then "
                   f"export FTQ_TEST_STOP_CHECKPOINT_DELAY_S=$(cat {base}/{SLOW_STOP}); fi")
    yield from slurm_stack(base, model_root, slurm_cluster, "--environment", environment)


def _finished(client: httpx.Client, job_id: str, timeout_s: float = 400) -> dict[str, Any]:
    return wait_job(client, job_id, lambda j: j["status"] not in ("queued", "running"), what="finished",
                    timeout_s=timeout_s)


def _slurm_logs(events: list[tuple[int, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The job's ``log`` events the bridge wrote (Slurm's states and reasons)."""
    return [data for _, kind, data in events if kind == "log" and data.get("source") == "slurm"]


def test_a_job_runs_through_slurm_to_succeeded(bridge, chat_dataset: Path):
    with bridge.client() as client:
        file_id = upload(client, chat_dataset)
        job = submit(client, file_id, hyperparameters=STEPS, pool="slurm", name="through slurm")
        assert job["pool"] == "slurm"
        events = follow(client, job["id"], timeout_s=400)
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["status"] == "succeeded", f"{done}\n{bridge.log_tail()}"
        assert [s["status"] for _, kind, s in events if kind == "state"] == ["queued", "running", "succeeded"]
        assert [s["step"] for _, kind, s in events if kind == "step"] == list(range(1, 7))
        metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        assert [m["step"] for m in metrics] == list(range(1, 7))
        slurm = _slurm_logs(events)
        assert slurm[0]["message"].startswith("submitted to Slurm as job "), slurm
        assert {"RUNNING", "COMPLETED"} <= {e.get("slurm_state") for e in slurm}, slurm
        attempt = bridge.data_dir.parent / "ftq-jobs" / job["id"] / "attempt-1"
        assert "#SBATCH --partition=ftq" in (attempt / "job.sbatch").read_text()
        assert "ftq-test profile: loaded" in (attempt / "stderr.log").read_text(), "the --environment ran, set -u off"


def test_a_full_fine_tuning_over_both_slurm_nodes_runs_one_torchrun_per_node(bridge, chat_dataset: Path):
    """srun starts one torchrun on each node of the allocation (c10d rendezvous at the first
    node's NodeAddr): two ranks, one per node, as Slurm's allocation shows. ``method: full``
    shards the model over the two nodes (FSDP2), which the cluster's shared directory allows: each
    rank writes its DCP shards into the job's ``shared_checkpoint_dir`` there."""
    with bridge.client() as client:
        file_id = upload(client, chat_dataset)
        job = submit(client, file_id, hyperparameters={**SHORT, "max_steps": 3}, pool="slurm", gpus=2, nodes=2,
                     method="full", checkpoint_every=3, name="two nodes")
        events = follow(client, job["id"], timeout_s=400)
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["status"] == "succeeded", f"{done}\n{bridge.log_tail()}"
        steps = [data for _, kind, data in events if kind == "step"]
        assert [s["step"] for s in steps] == [1, 2, 3]
        assert all([r["rank"] for r in s["ranks"]] == [0, 1] for s in steps)
        running = [e for e in _slurm_logs(events) if e.get("slurm_state") == "RUNNING"]
        assert running, _slurm_logs(events)
        script = (bridge.data_dir.parent / "ftq-jobs" / job["id"] / "attempt-1" / "job.sbatch").read_text()
        assert "#SBATCH --nodes=2" in script and "--nnodes=2" in script
        plan = next(data for _, kind, data in events if kind == "plan")
        assert {d["name"]: d["backend"] for d in plan["decisions"]}["parallelism"] == "fsdp2"
        shards = sorted(p.name for p in (bridge.data_dir.parent / "jobs" / job["id"]).rglob("*.distcp"))
        assert len(shards) >= 2, f"each rank's DCP shards in the shared directory: {shards}"


def test_a_cancel_stops_the_slurm_job_at_a_checkpoint(bridge, chat_dataset: Path):
    with bridge.client() as client:
        file_id = upload(client, chat_dataset)
        job = submit(client, file_id, hyperparameters=LONG, pool="slurm", name="cancelled on slurm")
        wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 2, what="past step 2", timeout_s=300)
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
        done = _finished(client, job["id"])
        assert done["status"] == "cancelled", f"{done}\n{bridge.log_tail()}"
        checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert checkpoints, "the trainer wrote a checkpoint when Slurm passed it ftq's TERM"
        slurm_id = _slurm_logs(follow(client, job["id"]))[0]["slurm_job_id"]
        assert _slurm_state(slurm_id) in ("COMPLETED", "CANCELLED", "FAILED")


RESUMED_STEPS = 80


def test_a_paused_slurm_job_resumes_from_its_checkpoint_in_the_shared_directory(bridge, chat_dataset: Path):
    """The trainer on Slurm writes its checkpoints into the cluster's shared directory and uploads
    none; the API host mounts it (the stack's API has FTQ_SHARED_DIR), so ``POST /resume`` finds the
    pause's checkpoint there and links it into the new job's directory there, where its trainer on
    Slurm resumes: the new job's first step is the checkpoint's + 1."""
    shared = bridge.data_dir.parent
    with bridge.client() as client:
        file_id = upload(client, chat_dataset)
        job = submit(client, file_id, hyperparameters={**SHORT, "max_steps": RESUMED_STEPS}, checkpoint_every=100_000,
                     pool="slurm", name="paused then resumed")
        wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 1, what="past step 1", timeout_s=300)
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
        done = _finished(client, job["id"])
        assert done["status"] == "cancelled", f"{done}\n{bridge.log_tail()}"
        (checkpoint,) = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        step = checkpoint["step"]
        assert 0 < step < RESUMED_STEPS
        assert (shared / "jobs" / job["id"] / "checkpoints" / layout.checkpoint_name(step)).is_dir()
        assert not (bridge.data_dir / "jobs" / job["id"] / "checkpoints" / layout.checkpoint_name(step)).exists(), \
            "nothing uploaded to the API's store: the shared directory is the only copy"

        response = client.post(f"/v1/jobs/{job['id']}/resume")
        assert response.status_code == 201, response.text
        resumed = response.json()
        events = follow(client, resumed["id"], timeout_s=400)
        final = client.get(f"/v1/jobs/{resumed['id']}").json()
        assert final["status"] == "succeeded", f"{final}\n{bridge.log_tail()}"
        steps = [data["step"] for _, kind, data in events if kind == "step"]
        assert steps == list(range(step + 1, RESUMED_STEPS + 1)), steps[:3]
        metrics = client.get(f"/v1/jobs/{resumed['id']}/metrics").json()["data"]
        assert metrics[0]["step"] == step + 1
        assert any(f"from its checkpoint at step {step}" in data.get("message", "")
                   for _, kind, data in events if kind == "log")
        seeded = shared / "jobs" / resumed["id"] / "checkpoints" / layout.checkpoint_name(step)
        assert seeded.is_dir(), "the checkpoint linked into the new job's directory in the shared directory"


def test_a_pause_right_after_the_slurm_job_started_reaches_the_trainer(bridge, chat_dataset: Path):
    """A stop while the batch script still runs the bridge's --environment: Slurm has no srun step
    to pass a TERM to yet and drops it (seen here: the trainer then trained hundreds of steps until the
    bridge's scancel cancel_grace_s later, whose TERM it checkpointed at only because Slurm's
    KillWait outlasted a tiny model's checkpoint). The bridge sends the TERM once the trainer's
    first event shows its handler in place: the stop, not the kill, ends it, every trained step in
    a checkpoint."""
    hold = bridge.data_dir.parent / HOLD
    hold.touch()
    try:
        with bridge.client() as client:
            file_id = upload(client, chat_dataset)
            job = submit(client, file_id, hyperparameters=LONG, checkpoint_every=100_000, pool="slurm",
                         name="paused at start")
            _until_event(client, job["id"], lambda e: e.get("slurm_state") == "RUNNING")
            assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
            _until_logged(bridge, f"job {job['id']}: stopping the trainer (cancel)")
    finally:
        hold.unlink(missing_ok=True)
    with bridge.client() as client:
        done = _finished(client, job["id"])
        assert done["status"] == "cancelled", f"{done}\n{bridge.log_tail()}"
        trained = [m["step"] for m in client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]]
        checkpoints = [c["step"] for c in client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]]
        assert max(trained, default=0) <= max(checkpoints, default=0), \
            f"steps {trained[:3]}..{trained[-3:]} trained after the pause, checkpoints {checkpoints}: the TERM was lost"
    assert f"job {job['id']}: trainer still running" not in bridge.logs["worker"].read_text(errors="replace"), \
        "the TERM was lost: the trainer trained on until the bridge's kill cancel_grace_s later"


def test_a_term_to_two_ranks_under_torchrun_waits_for_a_checkpoint_longer_than_30s(bridge, chat_dataset: Path):
    """Two ranks on one node under one torchrun, whose stop checkpoint takes 35 s, get Slurm's
    TERM (``scancel --signal=TERM``: what ftq's pause sends, and Slurm's preemption and
    ``--signal``). It reaches every process of the step, torchrun too, which forwards it and by
    default SIGKILLs its ranks 30 s later (seen here before the fix: no checkpoint). The batch
    script gives torchrun the whole stop grace: the checkpoint is written, and the next attempt
    (Slurm's TERM is a retry, ``slurm_signal``) resumes after it."""
    slow = bridge.data_dir.parent / SLOW_STOP
    slow.write_text(str(SLOW_STOP_S))
    try:
        with bridge.client() as client:
            file_id = upload(client, chat_dataset)
            job = submit(client, file_id, hyperparameters=LONG, checkpoint_every=100_000, pool="slurm", gpus=2,
                         name="slow checkpoint on TERM")
            wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 2, what="past step 2", timeout_s=300)
    finally:
        slow.unlink(missing_ok=True)  # read by the batch script at its start: the next attempt checkpoints at once
    from worker.slurm.commands import SlurmCli

    with bridge.client() as client:
        slurm_id = _until_event(client, job["id"], lambda e: bool(e.get("slurm_job_id")))["slurm_job_id"]
        assert SlurmCli().cancel(slurm_id, signal="TERM")
        last = wait_job(client, job["id"], lambda j: j["attempts"] == 2, what="attempt 2", timeout_s=300)
        wait_job(client, job["id"], lambda j: j["progress"]["step"] > last["progress"]["step"],
                 what="attempt 2 training", timeout_s=300)
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
        events = follow(client, job["id"], timeout_s=300)
    stderr = (bridge.data_dir.parent / "ftq-jobs" / job["id"] / "attempt-1" / "stderr.log").read_text(errors="replace")
    second = [seq for seq, kind, data in events if kind == "state" and data["status"] == "running"][1]
    before = [data["step"] for seq, kind, data in events if kind == "checkpoint" and seq < second]
    trained = [data["step"] for seq, kind, data in events if kind == "step" and seq < second]
    assert before == [max(trained)], \
        f"attempt 1 trained to step {max(trained)}, checkpoints {before}: its slow checkpoint was cut\n{stderr[-1500:]}"
    resumed = [data["step"] for seq, kind, data in events if kind == "step" and seq > second]
    assert resumed and resumed[0] == before[0] + 1, f"attempt 2's steps {resumed[:3]}.., checkpoint {before}"


def _until_event(client: httpx.Client, job_id: str, predicate, timeout_s: float = 300) -> dict[str, Any]:
    """The first event of the job's stream that ``predicate`` accepts (the stream is left open no longer)."""
    deadline = time.monotonic() + timeout_s
    with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=httpx.Timeout(30, read=60)) as response:
        for line in response.iter_lines():
            assert time.monotonic() < deadline, f"job {job_id}: no such event in {timeout_s}s"
            if line.startswith("data:") and predicate(data := json.loads(line[5:])):
                return data
    raise AssertionError(f"job {job_id} finished without such an event")


def _until_logged(stack: Stack, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in stack.logs["worker"].read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the bridge never logged {text!r}\n{stack.log_tail()}"
        time.sleep(0.3)


def test_a_killed_srun_step_is_resubmitted_and_resumes_with_each_step_once(bridge, chat_dataset: Path):
    with bridge.client() as client:
        file_id = upload(client, chat_dataset)
        # 120 steps: a tiny step takes tens of ms and the API sees a step a moment after the trainer ran
        # it, so a 12-step job could end before the kill (seen in CI: one attempt, succeeded)
        job = submit(client, file_id, hyperparameters={**SHORT, "max_steps": KILLED_STEPS}, checkpoint_every=10,
                     pool="slurm", name="killed step")
        wait_job(client, job["id"], lambda j: j["progress"]["step"] >= 11, what="past its first checkpoint",
                 timeout_s=300)
        pids = _trainer_pids(bridge, job["id"], attempt=1)
        assert pids, "the trainer of attempt 1 runs under slurmd"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        events = follow(client, job["id"], timeout_s=400)
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["status"] == "succeeded", f"{done}\n{bridge.log_tail()}"
        assert done["attempts"] == 2
        states = [s for _, kind, s in events if kind == "state"]
        assert [s["status"] for s in states] == ["queued", "running", "queued", "running", "succeeded"]
        assert states[2]["error_code"] == "killed", states[2]
        submitted = [e for e in _slurm_logs(events) if e["message"].startswith("submitted to Slurm")]
        assert len(submitted) == 2 and submitted[0]["slurm_job_id"] != submitted[1]["slurm_job_id"]
        metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        assert [m["step"] for m in metrics] == list(range(1, KILLED_STEPS + 1)), "every step recorded once"
        second_start = [seq for seq, kind, data in events if kind == "state" and data["status"] == "running"][1]
        resumed = [data["step"] for seq, kind, data in events if kind == "step" and seq > second_start]
        assert resumed == list(range(resumed[0], KILLED_STEPS + 1)) and (resumed[0] - 1) % 10 == 0 and resumed[0] > 1, \
            f"attempt 2 resumed after a checkpoint (every 10 steps): {resumed}"


def test_a_job_larger_than_the_partition_is_refused(bridge, chat_dataset: Path):
    with bridge.client() as client:
        file_id = upload(client, chat_dataset)
        body = {"model": "tiny-llama", "training_file": file_id, "hyperparameters": STEPS, "pool": "slurm"}
        nodes = client.post("/v1/jobs", json={**body, "gpus": 3, "nodes": 3})
        assert nodes.status_code == 422 and "nodes: 3" in nodes.text and "(2 nodes)" in nodes.text, nodes.text
        per_node = client.post("/v1/jobs", json={**body, "gpus": 6, "nodes": 2})
        assert per_node.status_code == 422 and "2 CPU slots each" in per_node.text, per_node.text
        unknown = client.post("/v1/jobs", json={**body, "pool": "kubernetes"})
        assert unknown.status_code == 422 and "no bridge serves pool 'kubernetes'" in unknown.text, unknown.text


def test_the_gpus_page_api_shows_the_slurm_pool(bridge):
    with bridge.client() as client:
        hosts = client.get("/v1/hardware").json()["data"]
    (host,) = [h for h in hosts if h["id"] == bridge.worker_id]
    pool = host["pool"]
    assert pool["kind"] == "slurm" and pool["partition"] == "ftq" and pool["nodes"] == 2 and pool["per_node"] == 2
    assert pool["cluster"]["nodes"]["idle"] + pool["cluster"]["nodes"]["allocated"] == 2
    assert pool["cluster"]["cpus"]["total"] >= 4


def _trainer_pids(stack: Stack, job_id: str, *, attempt: int) -> list[int]:
    """The trainer processes of one attempt (slurmd's children: found by their job.json path)."""
    needle = str(stack.data_dir.parent / "ftq-jobs" / job_id / f"attempt-{attempt}" / "job.json").encode()
    return pids_where(lambda argv: needle in argv and b"trainer" in argv)


def _slurm_state(slurm_job_id: str) -> str:
    from worker.slurm.commands import SlurmCli

    deadline = time.monotonic() + 60
    state = SlurmCli().state(slurm_job_id).state
    while state in ("RUNNING", "COMPLETING", "PENDING") and time.monotonic() < deadline:
        time.sleep(0.5)
        state = SlurmCli().state(slurm_job_id).state
    return state


def test_a_bridge_for_a_partition_slurm_lacks_fails_at_start(bridge):
    """Checked against the real cluster before the worker starts: a clear message, exit 2."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cli", "slurm-bridge", "--partition", "nope", "--shared-dir",
                           str(bridge.data_dir.parent)], env=bridge.env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done
    assert "partition 'nope' does not exist in this Slurm cluster (its partitions: ftq)" in done.stderr, done.stderr
