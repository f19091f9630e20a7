"""Issue 29's shared-storage proof on one CPU box: full fine-tuning over two machines (network
namespaces, conftest.py) whose workers mount one directory (``FTQ_SHARED_DIR``, a host directory
both namespaces see at the same path); every rank writes its DCP shards there, nothing is uploaded
but the final model. When the leader machine dies, the job resumes on the other machine alone
(``FTQ_SHRINK_AFTER_S=0`` here: at once) from the shared checkpoint, with the same global batch.

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
"""Relative, per step, against the 2-rank one-machine run. Before the loss: the same two ranks
over the same data shards, FSDP2 over gloo either way (a sum of two addends), one thread each
(measured: bitwise equal). After it: one rank takes both of a step's micro-batches (``gpus: 2``
fixes the global batch, docs/several-gpus.md) and the loss is divided by the same global label
count, so only the order of floating-point sums differs (float32 on the CPU: ~1e-7). A resume from
the shared checkpoint restores weights, AdamW state, schedule, data position and RNG exactly, on
any number of ranks."""


@pytest.fixture(scope="module")
def shared(cluster) -> Iterator[Path]:
    """Both machines' workers restarted with ``FTQ_SHARED_DIR`` (one host directory) and
    ``FTQ_SHRINK_AFTER_S=0`` (a retry resumes on the machines left at once) for this module; at
    its end they are stopped and lose both, so the next test that wants them
    (``Cluster.ensure_up``) starts them as the other tests expect."""
    directory = cluster.base / "shared"
    directory.mkdir(exist_ok=True)
    cluster.ensure_up()
    for name in ("m1", "m2"):
        cluster.stop_worker(name)
        cluster.machines[name].env.update(FTQ_SHARED_DIR=str(directory), FTQ_SHRINK_AFTER_S="0")
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
            cluster.machines[name].env.pop("FTQ_SHRINK_AFTER_S", None)


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


def _resumed_alone(job: dict) -> bool:
    assert job["status"] in ("queued", "running"), f"the job ended before it resumed: {job}"
    return job["status"] == "running" and job["attempts"] == 2


def test_full_fine_tuning_over_two_machines_matches_two_ranks_on_one_and_resumes_on_the_machine_left(
    cluster, up, chat_dataset, tmp_path
):
    """One training carries both proofs (each trainer start costs CI seconds): the leader (m1:
    rank 0, the one that renames each checkpoint into place) dies mid-run; the job goes back to the
    queue and resumes on m2 alone (1 of its 2 machines, ``FTQ_SHRINK_AFTER_S=0``) from the newest
    checkpoint recorded, which only the shared directory holds; m1 coming back meanwhile does not
    grow it. Every step is recorded once, and all of them, before and after the loss, are the
    losses of 2 ranks on one machine: the resumed rank trains both of each step's micro-batches."""
    shared = up
    with cluster.client() as client:
        job = _full_job(client, cluster, chat_dataset, "full over 2 machines, leader lost")
        running = wait_job(client, job["id"], lambda j: _past_a_checkpoint(client, j), what="past a recorded checkpoint",
                           logs=cluster.log_tail)
        assert running["worker"] == "m1", running
        cluster.kill_machine("m1")
        resumed = wait_job(client, job["id"], _resumed_alone, what="running again without m1",
                           logs=lambda: cluster.diagnose("m2"))
        assert resumed["worker"] == "m2", resumed
        cluster.revive_machine("m1")  # back mid-run: the job stays on m2
        done = finished(client, job["id"], logs=cluster.log_tail)
        assert done["status"] == "succeeded" and done["attempts"] == 2 and done["worker"] == "m2", \
            f"{done}\n{cluster.log_tail()}"
        rows = metrics(client, job["id"])
        history = events(client, job["id"])
        recorded = checkpoint_steps(client, job["id"])
        model = zip_files(client, f"/v1/jobs/{job['id']}/adapter")  # method full: the whole model
        refused = client.get(f"/v1/jobs/{job['id']}/checkpoints/{recorded[0]}/download")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "a step is missing or repeated"
    plans = [data for kind, data in history if kind == "plan"]
    assert len(plans) == 2, plans
    resumed_from = plans[1].get("resumed_from_step")
    assert resumed_from is not None and CHECKPOINT_EVERY <= resumed_from < STEPS, plans[1]
    assert plans[0]["world_size"] == 2 and plans[1]["world_size"] == 1, (plans[0], plans[1])
    assert [d["backend"] for d in plans[0]["decisions"] if d["name"] == "parallelism"] == ["fsdp2"]
    ranks = [sorted(r["rank"] for r in row["ranks"]) if row["ranks"] else [0] for row in rows]
    assert ranks[:resumed_from] == [[0, 1]] * resumed_from and ranks[-1] == [0], ranks
    fewer = [data for kind, data in history if kind == "log" and data.get("machines") == 1]
    assert len(fewer) == 1 and fewer[0]["nodes"] == 2 and "resumed on 1 of 2 machines" in fewer[0]["message"], fewer

    home = shared / "jobs" / job["id"] / "checkpoints"
    assert recorded == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    for step in recorded:  # every rank's shards in the one shared directory, the resumed ones included
        shards = sorted(p.name for p in (home / f"step-{step:06d}" / "dcp").glob("*.distcp"))
        ranks_then = 2 if step <= resumed_from else 1
        assert len(shards) == ranks_then, f"step {step}: expected {ranks_then} rank(s)' DCP shards in {home}: {shards}"
    assert not (cluster.api_data_dir / "jobs" / job["id"] / "checkpoints").exists(), "a checkpoint was uploaded"
    for machine in cluster.machines.values():
        assert not (machine.data_dir / "jobs" / job["id"] / "checkpoints").exists(), f"{machine.name} kept its own"
    assert any(name.endswith(".safetensors") for name in model), sorted(model)
    assert refused.status_code == 409 and "shared checkpoint directory" in refused.text, refused.text

    for name in ("m1", "m2"):  # the first attempt's leader, and the machine it resumed on alone
        job_json = cluster.machines[name].data_dir / "jobs" / job["id"] / "job.json"
        written = json.loads(job_json.read_text())
        assert written["shared_checkpoint_dir"] == str(shared / "jobs" / job["id"]) and written["gpus"] == 2, name
    expected = _reference_losses(cluster.machines["m1"].data_dir / "jobs" / job["id"] / "job.json", tmp_path / "reference")
    problems = _same_losses(rows, expected)
    assert not problems, "\n".join(problems)
