"""Two ranks (torchrun, gloo on the CPU) train as one process does with the same global batch,
and a checkpoint of two ranks resumes on one (and a one-process full checkpoint on four).
The LoRA runs also sample greedy answers at each checkpoint (``SAMPLES``): under FSDP2 every rank
runs the sampler's forwards in step, and rank 0's samples are the one process's.

The same tiny job (``gpus: 2`` x ``grad_accum: 2`` micro-batches per step) runs once as a single
process, which accumulates all four micro-batches (in the test's own process, ``run_here``: what
``python -m trainer run`` does, without its ~5 s of start-up and imports), and once under ``torchrun
--nproc_per_node=2``, where each rank trains two and the gradients meet in DDP's all-reduce
(LoRA) or FSDP2's reduce-scatter (full fine-tuning, parameters and AdamW state sharded).

Tolerances. Everything is float32 on the CPU with one thread per process, so each micro-batch's
forward and backward are the same arithmetic in both runs; what differs is the order in which the
parts are summed (a rank's two micro-batches, then the ranks' sums) and, under FSDP2, the grad
norm summed shard by shard. That is a few float32 roundings (2**-24 ~ 6e-8 relative) per step:
over six steps the losses agree to ~1e-7 and the grad norms to under 1e-6 relative (measured).
``LOSS_RTOL = 1e-5`` (for both) leaves more than ten times that, while any real error is far
outside it: a micro-batch lost or counted twice,
or a loss normalised per rank instead of by the step's global label count, moves the step loss by
percents. Weights: ``WEIGHT_ATOL`` is a two-hundredth of one AdamW update of the method (each
moves a weight by about the learning rate, 1e-3 full -> 5e-6, 1e-2 LoRA -> 5e-5), so one missed
update would show. The summation-order noise is what AdamW divides by a small second moment early
on, so it scales with the learning rate: with transformers 5.23 one LoRA A weight of the two-rank
run landed 1.15e-6 from the one-process run's (every other weight within 1.4e-7); on session 18's
AVX-512 CI machine the same run (session 17's code too) put one element of
``layers.1.mlp.down_proj.lora_A`` 1.14e-5 away (every other weight within 1.3e-6), over the 5e-6
that both methods shared before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_helpers import (
    CHECKPOINT_EVERY,
    STEPS,
    Finished,
    launch,
    resume_copy,
    run_here,
    weights,
    write_job,
)

from trainer_helpers import make_job

from trainer.training import layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOSS_RTOL = 1e-5
WEIGHT_ATOL = {"full": 5e-6, "lora": 5e-5}
RESUME_AT = CHECKPOINT_EVERY
PROMPTS = ("What is 4 plus one?", "Say something.", "What is 2 plus 2?")
SAMPLES = {"sample_prompts": PROMPTS, "sample_max_new_tokens": 12}
"""The LoRA runs' checkpoint samples. Under FSDP2 each of the sampler's forwards all-gathers the
sharded base: a rank that ran one forward fewer would hang the other (the launch's timeout would
fail the test). The weights of the runs agree within ``WEIGHT_ATOL``, far from moving any greedy
choice of these prompts."""


class _Runs:
    """Each (method, ranks) run of the module's job, launched once on first use."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root, self.model_dir = root, model_dir
        self._done: dict[tuple[str, int], Finished] = {}

    def get(self, method: str, ranks: int) -> Finished:
        key = (method, ranks)
        if key not in self._done:
            job = write_job(self.root / f"{method}-{ranks}", self.model_dir, method,
                            **(SAMPLES if method == "lora" else {}))
            run = run_here(job) if ranks == 1 else launch(job, ranks)
            assert run.returncode == 0 and run.done["status"] == "succeeded", (run.done, run.stderr[-3000:])
            self._done[key] = run
        return self._done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("ranks"), tiny_model_dir)


def _assert_same_curve(run: Finished, reference: Finished, steps: range) -> None:
    got, want = run.steps(), reference.steps()
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        for field in ("loss", "grad_norm"):
            assert got[step][field] == pytest.approx(want[step][field], rel=LOSS_RTOL), (step, field)


def _assert_same_samples(run: Finished, reference: Finished) -> None:
    got, want = run.of("sample"), reference.of("sample")
    assert [e["step"] for e in got] == [e["step"] for e in want] == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    for event in got:
        assert [s["prompt"] for s in event["samples"]] == list(PROMPTS)
        assert all(s["tokens"] > 0 for s in event["samples"])
    assert [e["samples"] for e in got] == [e["samples"] for e in want]


def _assert_same_weights(a: dict, b: dict, method: str) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=WEIGHT_ATOL[method],
                                   msg=lambda detail, name=name: f"{name}: {detail}")


@pytest.mark.parametrize(("method", "strategy"), [("lora", "ddp"), ("full", "fsdp2")])
class TestTwoRanksFollowOneProcess:
    def test_loss_grad_norm_and_validation_agree_at_every_step(self, runs, method, strategy):
        one, two = runs.get(method, 1), runs.get(method, 2)
        _assert_same_curve(two, one, range(1, STEPS + 1))
        assert [e["loss"] for e in two.of("eval")] == pytest.approx([e["loss"] for e in one.of("eval")], rel=LOSS_RTOL)
        assert len(two.of("eval")) == STEPS // CHECKPOINT_EVERY

    def test_the_plan_names_the_strategy_and_the_world(self, runs, method, strategy):
        (plan,) = runs.get(method, 2).of("plan")
        decision = next(d for d in plan["decisions"] if d["name"] == "parallelism")
        assert decision["enabled"] and decision["backend"] == strategy
        assert plan["world_size"] == 2 and plan["hardware"]["interconnect"] == "TCP (gloo)"
        assert "2 ranks over TCP (gloo)" in decision["reason"]
        (single,) = runs.get(method, 1).of("plan")
        assert single["world_size"] == 1
        assert next(d for d in single["decisions"] if d["name"] == "parallelism")["backend"] is None

    def test_every_step_event_carries_both_ranks(self, runs, method, strategy):
        for event in runs.get(method, 2).of("step"):
            assert [r["rank"] for r in event["ranks"]] == [0, 1]
            assert sum(r["tokens"] for r in event["ranks"]) == event["tokens"]
        assert all(e["ranks"] is None for e in runs.get(method, 1).of("step"))

    def test_the_exported_weights_agree(self, runs, method, strategy):
        one, two = runs.get(method, 1), runs.get(method, 2)
        export = layout.export_dir(two.out, method)
        assert two.done["adapter_path"] == str(export)
        _assert_same_weights(weights(export), weights(layout.export_dir(one.out, method)), method)


class TestCheckpointsOfTwoRanks:
    def test_full_checkpoints_are_sharded_per_rank_and_never_left_half_written(self, runs):
        two = runs.get("full", 2)
        root = layout.checkpoints_dir(two.out)
        assert sorted(p.name for p in root.iterdir()) == [layout.checkpoint_name(s) for s in (2, 4, 6)]
        shards = layout.sharded_state_dir(layout.checkpoint_dir(two.out, 2))
        assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert not list(root.glob("*/*.safetensors")), "a full checkpoint is the DCP shards, not a model copy"
        assert not list(root.glob(f"*{layout.PARTIAL_SUFFIX}"))

    def test_adapter_checkpoints_are_written_once(self, runs):
        checkpoint = layout.checkpoint_dir(runs.get("lora", 2).out, 2)
        assert (checkpoint / "adapter_model.safetensors").is_file()
        assert not layout.sharded_state_dir(checkpoint).exists()

    def test_a_one_process_full_checkpoint_resumes_sharded_on_four_ranks(self, runs, tmp_path, tiny_model_dir):
        """The other direction: one process's DCP checkpoint is resharded four ways under FSDP2. The
        global step (gpus 2 x grad_accum 2 = four micro-batches) does not depend on who runs it:
        four ranks (one micro-batch each) continue on the uninterrupted one-process curve. (Full
        fine-tuning only: a LoRA checkpoint is the same replicated adapter on any rank count, its
        2 -> 1 resume is tested below; a two-rank checkpoint resumed on four cost CI a launch of
        five processes more and resharded the same way.)"""
        one = runs.get("full", 1)
        job = resume_copy(layout.checkpoint_dir(one.out, RESUME_AT), tmp_path, tiny_model_dir, "full")
        resumed = launch(job, 4, timeout=240)
        assert resumed.done["status"] == "succeeded", (resumed.done, resumed.stderr[-3000:])
        (plan,) = resumed.of("plan")
        assert plan["resumed_from_step"] == RESUME_AT and plan["world_size"] == 4
        assert all(len(e["ranks"]) == 4 for e in resumed.of("step"))
        _assert_same_curve(resumed, one, range(RESUME_AT + 1, STEPS + 1))
        _assert_same_weights(weights(layout.export_dir(resumed.out, "full")), weights(layout.export_dir(one.out, "full")), "full")

    @pytest.mark.parametrize("method", ["lora", "full"])
    def test_a_two_rank_checkpoint_resumes_on_one_rank_as_if_never_stopped(self, runs, tmp_path, tiny_model_dir, method):
        """Two ranks to step 2 (their checkpoint, as a stop there leaves it), then one process to
        the end: the curve and the weights are the uninterrupted one-process run's."""
        two, one = runs.get(method, 2), runs.get(method, 1)
        job = resume_copy(layout.checkpoint_dir(two.out, RESUME_AT), tmp_path, tiny_model_dir, method)
        resumed = run_here(job)
        assert resumed.done["status"] == "succeeded", (resumed.done, resumed.stderr[-3000:])
        (plan,) = resumed.of("plan")
        assert plan["resumed_from_step"] == RESUME_AT and plan["world_size"] == 1
        _assert_same_curve(resumed, one, range(RESUME_AT + 1, STEPS + 1))
        _assert_same_weights(weights(layout.export_dir(resumed.out, method)), weights(layout.export_dir(one.out, method)), method)


class TestLoraOverAShardedBase:
    def test_fsdp2_lora_follows_one_process_and_checkpoints_only_the_adapters(self, runs, tmp_path, tiny_model_dir):
        """A LoRA base too big for one GPU is sharded with FSDP2 (forced here: a CPU has no GPU
        memory to exceed). Mixed precision keeps the frozen base and the fp32 adapters apart; the
        checkpoint holds only the adapters and their AdamW state; the export is gathered to rank 0
        and saved as the peft adapter."""
        from torch.distributed.checkpoint import FileSystemReader

        one = runs.get("lora", 1)
        two = launch(write_job(tmp_path, tiny_model_dir, "lora", **SAMPLES), 2, fsdp2=True)
        assert two.done["status"] == "succeeded", (two.done, two.stderr[-3000:])
        decision = next(d for d in two.of("plan")[0]["decisions"] if d["name"] == "parallelism")
        assert decision["backend"] == "fsdp2"
        _assert_same_samples(two, one)
        _assert_same_curve(two, one, range(1, STEPS + 1))
        _assert_same_weights(weights(layout.export_dir(two.out, "lora")), weights(layout.export_dir(one.out, "lora")), "lora")
        shards = layout.sharded_state_dir(layout.checkpoint_dir(two.out, RESUME_AT))
        saved = FileSystemReader(shards).read_metadata().state_dict_metadata
        model_keys = [k for k in saved if k.startswith("model.")]
        assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)


class TestAShortLastStep:
    def test_a_rank_with_nothing_to_train_runs_a_stand_in_and_the_curve_holds(self, tmp_path, tiny_model_dir):
        """One epoch of five micro-batches in steps of gpus 2 x grad_accum 1: the last step has one
        micro-batch for two ranks. Under FSDP2 the empty rank runs a zero-weighted stand-in so the
        parameter gathers and the gradient reduce-scatter still pair; the curve (loss and the
        gathered grad norm) is the one process's, and the step event shows the empty rank."""
        from trainer.config import OptimConfig

        jobs = []
        for ranks in (1, 2):
            directory = tmp_path / str(ranks)
            directory.mkdir()
            config = make_job(
                directory, tiny_model_dir, method="full", gpus=2,
                optim=OptimConfig(epochs=1.0, warmup_steps=1, learning_rate=1e-3),
            )
            config.save(directory / "job.json")
            jobs.append(run_here(directory / "job.json") if ranks == 1 else launch(directory / "job.json", ranks))
        one, two = jobs
        assert two.done["status"] == "succeeded", (two.done, two.stderr[-3000:])
        assert sorted(one.steps()) == sorted(two.steps()) == [1, 2, 3]
        _assert_same_curve(two, one, range(1, 4))
        assert [r["tokens"] > 0 for r in two.steps()[3]["ranks"]] == [True, False]

