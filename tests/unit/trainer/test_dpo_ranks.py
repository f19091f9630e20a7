"""DPO on two ranks (torchrun, gloo on the CPU, DDP over the adapters) follows one process.

The same LoRA DPO job (``gpus: 2`` x ``grad_accum: 2`` packed micro-batches of pairs per step)
runs as one process and as two ranks. Each rank's reference pass (adapters off, no autograd) and
policy pass run inside DDP's forward; the loss is divided by the step's global pair count and the
pair statistics are summed over micro-batches and ranks, so loss, grad norm and the four reward
fields must agree step by step. Tolerance as in ``test_distributed_runs``: float32 with one thread
per process, only the summation order differs (measured ~1e-7): 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed_helpers import launch
from trainer_helpers import Recorder, make_job, write_jsonl

from trainer.config import DataConfig, DpoConfig, OptimConfig
from trainer.objectives.declarations import DPO_STEP_FIELDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
RTOL = 1e-5
STEPS = 4


def write_dpo_job(directory: Path, model_dir: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    pairs = write_jsonl(directory / "pairs.jsonl", [
        {"input": {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]},
         "preferred_output": [{"role": "assistant", "content": f"The answer is {2 * i}."}],
         "non_preferred_output": [{"role": "assistant", "content": "No idea." if i % 2 else "I would rather not say."}]}
        for i in range(24)
    ])
    config = make_job(
        directory, model_dir, gpus=2, gradient_checkpointing=True, objective="dpo", dpo=DpoConfig(beta=0.2),
        data=DataConfig(str(pairs), max_seq_len=64, batch_tokens=192),
        optim=OptimConfig(max_steps=STEPS, grad_accum=2, warmup_steps=1, learning_rate=1e-2),
    )
    config.save(directory / "job.json")
    return directory / "job.json"


@pytest.mark.usefixtures("one_thread")  # the ranks run one thread each: the same arithmetic
def test_two_ranks_follow_one_process_with_the_same_rewards(tmp_path: Path, tiny_model_dir: Path) -> None:
    from trainer.config import TrainConfig
    from trainer.training.train import run

    one = Recorder()  # the one-process run in this process (saves a start-up), as `python -m trainer run` does
    assert run(TrainConfig.load(write_dpo_job(tmp_path / "one", tiny_model_dir)), one).status == "succeeded"
    two = launch(write_dpo_job(tmp_path / "two", tiny_model_dir), 2)
    assert two.returncode == 0 and two.done["status"] == "succeeded", (two.done, two.stderr[-3000:])
    [plan] = two.of("plan")
    assert {d["name"]: d["backend"] for d in plan["decisions"]}["parallelism"] == "ddp"
    got, want = two.steps(), {e["step"]: e for e in one.of("step")}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["sequences"] == want[step]["sequences"] > 2
        for field in ("loss", "grad_norm", *DPO_STEP_FIELDS):
            assert got[step][field] == pytest.approx(want[step][field], rel=RTOL, abs=1e-7), (step, field)
    assert want[STEPS]["reward_margin"] > want[1]["reward_margin"]
