"""Issue 29's shared-storage proof on one CPU box: full fine-tuning over two machines (network
namespaces, conftest.py) whose workers mount one directory (``FTQ_SHARED_DIR``, a host directory
both namespaces see at the same path); every rank writes its DCP shards there, nothing is uploaded
but the final model.

The reference is the same job.json run by ``torchrun --standalone --nproc-per-node=2`` on one
machine (this process's own): 2 ranks, gloo, one thread each, as the machines run them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns.cluster import REPO_ROOT
from tests.netns.jobs import TINY, checkpoint_steps, events, finished, metrics, submit, upload, wait_job, zip_files

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.netns]

STEPS = 18
CHECKPOINT_EVERY = 3
HYPER = {**TINY, "max_steps": STEPS}
LOSS_TOLERANCE = 1e-5
"""Relative, per step, against the 2-rank one-machine run: the same two ranks over the same data
shards, FSDP2 over gloo either way (a sum of two addends), one thread each; only a different order
of floating-point sums could differ, far under this (measured: 0.0, every step bitwise equal, the
resumed ones included). A resume from the shared checkpoint restores weights, AdamW state,
schedule, data position and RNG exactly."""


@pytest.fixture(scope="module")
def shared(cluster) -> Iterator[Path]:
    """Both machines' workers restarted with ``FTQ_SHARED_DIR`` (one host directory) for this
    module; at its end they are stopped and lose the variable, so the next test that wants them
    (``Cluster.ensure_up``) starts them as the other tests expect."""
    directory = cluster.base / "shared"
    directory.mkdir(exist_ok=True)
    cluster.ensure_up()
    for name in ("m1", "m2"):
        cluster.stop_worker(name)
        cluster.machines[name].env["FTQ_SHARED_DIR"] = str(directory)
        cluster.start_worker(name)

    def registered_again() -> bool:  # the stopped workers' rows stay live a while
        rows = {w["id"]: w for w in cluster.hardware()["data"]}
        return all(rows[name]["shared_dir"] == str(directory) and rows[name]["shared_id"] for name in ("m1", "m2"))

    cluster.wait(registered_again, f"workers m1, m2 registered with FTQ_SHARED_DIR={directory}")
    cluster.wait_workers(["m1", "m2"])
    try:
        yield directory
    finally:
        for name in ("m1", "m2"):
            cluster.stop_worker(name, timeout_s=20)
            cluster.machines[name].env.pop("FTQ_SHARED_DIR", None)


@pytest.fixture
def up(cluster, shared: Path) -> Path:
    """Both machines up with the shared directory (a test before may have killed one)."""
    cluster.ensure_up()
    return shared


def _reference_losses(job_json: Path, work: Path) -> list[float]:
    """The per-step losses of the 2-machine run's job.json run as 2 ranks on this one machine."""
    from trainer.config import TrainConfig

    work.mkdir(parents=True, exist_ok=True)
    config = TrainConfig.load(job_json)
    dataclasses.replace(config, output_dir=str(work / "out"), shared_checkpoint_dir=None).save(work / "job.json")
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "trainer", "run", str(work / "job.json")], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"the 2-rank reference failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [e["loss"] for e in lines if e.get("type") == "step"]


def _same_losses(rows: list[dict], expected: list[float]) -> list[str]:
    assert len(expected) == len(rows) == STEPS, f"{len(rows)} steps recorded, {len(expected)} in the reference"
    return [f"step {row['step']}: 2 machines {row['loss']!r}, 2 ranks on one machine {want!r}"
            for row, want in zip(rows, expected)
            if row["loss"] is None or not math.isclose(row["loss"], want, rel_tol=LOSS_TOLERANCE)]


def _full_job(client, cluster, chat_dataset, name: str) -> dict:
    file_id = upload(client, chat_dataset)
    return submit(client, file_id, cluster.model, method="full", hyperparameters=HYPER, gpus=2, nodes=2,
                  checkpoint_every=CHECKPOINT_EVERY, name=name)


def _past_a_checkpoint(client, job: dict) -> bool:
    assert job["status"] in ("queued", "running"), f"the job ended before a machine could be lost: {job}"
    return job["status"] == "running" and job["progress"]["step"] > CHECKPOINT_EVERY and bool(
        checkpoint_steps(client, job["id"]))


def test_full_fine_tuning_over_two_machines_matches_two_ranks_on_one_and_survives_losing_one(
    cluster, up, chat_dataset, tmp_path
):
    """One training carries both proofs (each trainer start costs CI seconds): the leader (m1:
    rank 0, the one that renames each checkpoint into place) dies mid-run; the job goes back to the
    queue and, as ftq keeps a job's machine count, resumes on both machines once m1 is back, from
    the newest checkpoint recorded, which only the shared directory holds. Every step is recorded
    once, and all of them, before and after the loss, are the losses of 2 ranks on one machine."""
    shared = up
    with cluster.client() as client:
        job = _full_job(client, cluster, chat_dataset, "full over 2 machines, leader lost")
        running = wait_job(client, job["id"], lambda j: _past_a_checkpoint(client, j), what="past a recorded checkpoint",
                           logs=cluster.log_tail)
        assert running["worker"] == "m1", running
        cluster.kill_machine("m1")
        wait_job(client, job["id"], lambda j: j["status"] == "queued", what="back in the queue",
                 logs=lambda: cluster.diagnose("m2"))
        newest = checkpoint_steps(client, job["id"])[-1]
        assert newest < STEPS
        cluster.revive_machine("m1")
        done = finished(client, job["id"], logs=cluster.log_tail)
        assert done["status"] == "succeeded" and done["attempts"] == 2, f"{done}\n{cluster.log_tail()}"
        rows = metrics(client, job["id"])
        history = events(client, job["id"])
        recorded = checkpoint_steps(client, job["id"])
        model = zip_files(client, f"/v1/jobs/{job['id']}/adapter")  # method full: the whole model
        refused = client.get(f"/v1/jobs/{job['id']}/checkpoints/{newest}/download")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step is missing or repeated"
    assert [sorted(r["rank"] for r in row["ranks"] or []) for row in rows] == [[0, 1]] * STEPS
    plans = [data for kind, data in history if kind == "plan"]
    assert len(plans) == 2 and plans[1].get("resumed_from_step") == newest, (newest, plans[-1:])
    assert all(d["backend"] == "fsdp2" for plan in plans for d in plan["decisions"] if d["name"] == "parallelism")

    home = shared / "jobs" / job["id"] / "checkpoints"
    assert recorded == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    for step in recorded:  # every rank's shards in the one shared directory, the resumed one included
        shards = sorted(p.name for p in (home / f"step-{step:06d}" / "dcp").glob("*.distcp"))
        assert len(shards) == 2, f"step {step}: expected both ranks' DCP shards in {home}, found {shards}"
    assert not (cluster.api_data_dir / "jobs" / job["id"] / "checkpoints").exists(), "a checkpoint was uploaded"
    for machine in cluster.machines.values():
        assert not (machine.data_dir / "jobs" / job["id"] / "checkpoints").exists(), f"{machine.name} kept its own"
    assert any(name.endswith(".safetensors") for name in model), sorted(model)
    assert refused.status_code == 409 and "shared checkpoint directory" in refused.text, refused.text

    job_json = cluster.machines["m1"].data_dir / "jobs" / job["id"] / "job.json"
    assert json.loads(job_json.read_text())["shared_checkpoint_dir"] == str(shared / "jobs" / job["id"])
    expected = _reference_losses(job_json, tmp_path / "reference")
    problems = _same_losses(rows, expected)
    assert not problems, "\n".join(problems)
