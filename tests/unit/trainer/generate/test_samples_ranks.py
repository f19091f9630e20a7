"""Checkpoint samples under two FSDP2 ranks (gloo, CPU): every rank runs the sampler's forwards
in step, and rank 0's samples are the one-process run's.

LoRA with FSDP2 forced (``force_fsdp2.py``), so each forward all-gathers the sharded base: a rank
that ran one forward fewer would hang the other (the launch's timeout would fail the test). The
weights of the two runs agree within ~1e-6 (tests/unit/trainer/parallel/test_distributed_runs.py),
far from moving any greedy choice of these prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_helpers import launch, write_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ("What is 4 plus one?", "Say something.", "What is 2 plus 2?")


def test_fsdp2_ranks_sample_in_step_and_as_one_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    runs = {}
    for ranks in (1, 2):
        job = write_job(tmp_path / str(ranks), tiny_model_dir, "lora", steps=2, checkpoint_every=2,
                        sample_prompts=PROMPTS, sample_max_new_tokens=12)
        runs[ranks] = launch(job, ranks, fsdp2=ranks == 2)
        assert runs[ranks].done["status"] == "succeeded", (runs[ranks].done, runs[ranks].stderr[-3000:])
    decision = next(d for d in runs[2].of("plan")[0]["decisions"] if d["name"] == "parallelism")
    assert decision["backend"] == "fsdp2"
    [one], [two] = runs[1].of("sample"), runs[2].of("sample")
    assert [s["prompt"] for s in two["samples"]] == list(PROMPTS)
    assert two["samples"] == one["samples"] and all(s["tokens"] > 0 for s in two["samples"])
