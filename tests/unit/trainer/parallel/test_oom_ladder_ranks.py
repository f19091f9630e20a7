"""The OOM ladder on several ranks (``trainer.parallel.oom_ladder``, ``Parallel.agree``): one DDP
rank of two runs out of memory in the first step; both step the activation policy down together
and retry the step on the same data, and the run follows an uninterrupted one exactly.

The OOM is real: ``FTQ_TEST_ACTIVATION_BUDGET_BYTES`` arms the activation policy's budget probe
(``trainer.features.checkpointing.policy``) and ``FTQ_TEST_ACTIVATION_BUDGET_RANKS=1`` arms it on
rank 1 only, so rank 0 finishes its backward and must learn from the agreement that the step
failed. The budget is what full checkpointing saves (the two layers' inputs of a 256-token
micro-batch in float32): keeping every activation and checkpointing half the layers run out,
full checkpointing fits. The reference is the same 2-rank job with full checkpointing from the
start (its window's steps also end in the agreement). gloo, float32, 2 ranks: tolerance 0.

Both runs use DDP's reducer (``FTQ_DDP_EXCHANGE=overlapped``, what a run across machines gets):
its ``no_sync`` inside the window and its bucketed exchange after it are covered here, while the
one-machine default (one flat exchange after backward) is what ``test_distributed_runs``' LoRA
runs compare with one process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from distributed_helpers import STEPS, launch, weights, write_job

from trainer.config import TrainConfig
from trainer.features.checkpointing.policy import BUDGET_ENV, BUDGET_RANKS_ENV
from trainer.parallel.strategy import EXCHANGE_ENV, OVERLAPPED
from trainer.training import layout

pytestmark = pytest.mark.slow  # two torchrun launches of 2 CPU ranks: ~30 s

FULL_CHECKPOINTING_BYTES = 2 * 256 * 64 * 4
"""Layers x batch_tokens (``make_job``) x hidden (``trainer.model.tiny``) x fp32."""


def _job(directory: Path, model_dir: Path, policy: str) -> Path:
    job = write_job(directory, model_dir, "lora", checkpoint_every=0)
    config = TrainConfig.load(job)
    dataclasses.replace(config, gradient_checkpointing=policy).save(job)
    return job


def test_one_rank_out_of_memory_steps_every_rank_down_on_the_same_curve(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(EXCHANGE_ENV, OVERLAPPED)
    reference = launch(_job(tmp_path / "full", tiny_model_dir, "on"), 2)
    assert reference.returncode == 0, reference.stderr[-3000:]
    monkeypatch.setenv(BUDGET_ENV, str(FULL_CHECKPOINTING_BYTES))
    monkeypatch.setenv(BUDGET_RANKS_ENV, "1")
    laddered = launch(_job(tmp_path / "ladder", tiny_model_dir, "off"), 2)
    assert laddered.returncode == 0 and laddered.done["status"] == "succeeded", laddered.stderr[-3000:]

    (plan,) = laddered.of("plan")
    parallelism = {d["name"]: d for d in plan["decisions"]}["parallelism"]
    assert parallelism["backend"] == "ddp" and "in buckets under backward" in parallelism["reason"]
    warnings = [e["message"] for e in laddered.of("log") if e["level"] == "warning"]
    assert len(warnings) == 2, warnings
    # rank 0 (whose events these are) did not run out itself: it names the rank that did
    assert warnings[0].startswith("out of memory at step 1 with activation policy none (rank 1 of 2: ")
    assert "stepped down to selective:1/2" in warnings[0] and "retrying step 1 on the same data" in warnings[0]
    assert "with activation policy selective:1/2" in warnings[1] and "stepped down to full" in warnings[1]

    got, want = laddered.steps(), reference.steps()
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in got]
    assert [got[s]["tokens"] for s in got] == [want[s]["tokens"] for s in got]
    trained = weights(layout.export_dir(laddered.out, "lora"))
    expected = weights(layout.export_dir(reference.out, "lora"))
    assert trained.keys() == expected.keys()
    for name, tensor in trained.items():
        assert tensor.equal(expected[name]), name
