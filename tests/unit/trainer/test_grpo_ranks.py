"""GRPO on two ranks (torchrun, gloo on the CPU, DDP over the adapters) follows one process.

The same LoRA GRPO job (``gpus: 2`` x ``grad_accum: 1`` micro-batches of two prompts' groups per
step) runs as one process and as two ranks. Each rank samples only the prompts of its own
micro-batch, with seeds made of the job's seed, the step and the prompt's index (not the rank), so
the two runs sample the same completions; ``scale_rewards: batch`` divides the advantages by the
spread of the whole step's rewards and ``loss_type: dapo`` by the step's completion tokens, both
gathered over the ranks; the reward statistics are summed over micro-batches and ranks. The epoch
ends on a step of one micro-batch, which rank 1 pairs with a zero-weighted stand-in made of
prompts it never sampled.

Tolerances. The reward fields and completion lengths must be equal: they count the same sampled
tokens (a rank's sampler runs a batch of its own prompts' sequences, 8 where the one process runs
16; a token's probabilities may differ in the last float32 bit, and a seeded draw would have to
fall that close to a boundary to change it). Loss and grad norm: 1e-5 relative, as for SFT and DPO,
with 1e-7 absolute for losses near 0 (an on-policy step's loss is the advantages' token-weighted
sum: ~1e-8 on steps 1 and 3 here); the trained adapters within 5e-6, as in ``test_distributed_runs``.
Measured: all of it equal to the bit (one thread per process, each rank computes a whole micro-batch
of the one process's, and a sum of two terms is the same in either order).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed_helpers import Finished, launch, weights
from trainer_helpers import Recorder, make_job, write_jsonl

from trainer.config import DataConfig, OptimConfig
from trainer.objectives.declarations import GRPO
from trainer.objectives.grpo import Grpo, PromptItem
from trainer.objectives.grpo_config import GrpoConfig
from trainer.objectives.grpo_loss import group_advantages
from trainer.training import layout
from trainer.training.flops import FlopCounter

RTOL = 1e-5
WEIGHT_ATOL = 5e-6
PROMPTS = ("Once upon", "The old house", "Hello there", "In the morning", "The big dog", "My friend",
           "The small house", "A long road", "The blue sky", "Good morning", "The last day", "Her brother",
           "One night", "A bright star")
"""Fourteen prompts of 7-9 tokens (the tiny tokenizer's, with its bos): a group packs as 6..8 prompt
tokens and 4 x (1 + 6) (the prompt shared, ``Grpo.pack``), 34-36 tokens, so two fit ``batch_tokens``
(4 x 24) and three never do: seven micro-batches in the epoch."""
GROUP, NEW = 4, 6
STEPS = 4
"""One epoch of seven micro-batches, two a step: three full steps and a last of one. Its prompts
come once in the epoch, so rank 1, whose stand-in packs them, never sampled them."""
GRADER = {"type": "string_check", "name": "has an e", "input": "{{sample.output_text}}", "reference": "e",
          "operation": "ilike"}
"""Pays for an ``e`` anywhere in the completion: about half the tiny model's completions have one, so
most groups have a spread."""


def write_grpo_job(directory: Path, model_dir: Path, method: str = "lora") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(directory / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    config = make_job(
        directory, model_dir, gpus=2, objective="grpo", method=method,
        data=DataConfig(str(prompts), max_seq_len=64, batch_tokens=GROUP * 24),
        optim=OptimConfig(epochs=1, grad_accum=1, warmup_steps=1, learning_rate=1e-2 if method == "lora" else 1e-3),
        grpo=GrpoConfig(graders=GRADER, group_size=GROUP, max_new_tokens=NEW, loss_type="dapo",
                        scale_rewards="batch"),
    )
    config.save(directory / "job.json")
    return directory / "job.json"


def _run_both(tmp_path: Path, model_dir: Path, method: str, *, fsdp2: bool = False) -> tuple[Recorder, Finished]:
    """The job as one process (in this process, as ``python -m trainer run`` does) and as two ranks."""
    from trainer.config import TrainConfig
    from trainer.training.train import run

    one = Recorder()
    assert run(TrainConfig.load(write_grpo_job(tmp_path / "one", model_dir, method)), one).status == "succeeded", \
        one.of("done")
    two = launch(write_grpo_job(tmp_path / "two", model_dir, method), 2, fsdp2=fsdp2)
    assert two.returncode == 0 and two.done["status"] == "succeeded", (two.done, two.stderr[-3000:])
    return one, two


def _assert_same_steps(one: Recorder, two: Finished, strategy: str) -> dict[int, dict]:
    """Equal reward fields and tokens, loss and grad norm within ``RTOL`` at every step; the one
    process's steps."""
    [plan] = two.of("plan")
    assert {d["name"]: d["backend"] for d in plan["decisions"]}["parallelism"] == strategy
    got, want = two.steps(), {e["step"]: e for e in one.of("step")}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert [want[s]["sequences"] for s in want] == [4, 4, 4, 2], "prompts a step: the last step is short"
    fields = [m.name for m in GRPO.metrics if not m.name.endswith("_ms")]  # timings: host wall clock
    for step in want:
        assert {f: got[step][f] for f in fields} == {f: want[step][f] for f in fields}, step
        assert got[step]["tokens"] == want[step]["tokens"], step  # sampled tokens, summed over the ranks
        for field in ("loss", "grad_norm"):
            assert got[step][field] == pytest.approx(want[step][field], rel=RTOL, abs=1e-7), (step, field)
    assert any(0 < want[s]["reward_mean"] < 1 and want[s]["zero_std_fraction"] < 1 for s in want)
    trained = [s for s in want if want[s]["zero_std_fraction"] < 1]  # a group with a spread: a gradient
    assert len(trained) >= STEPS - 1 and all(want[s]["grad_norm"] > 0.01 for s in trained), want
    # rank 0 emits the first rollouts of its own prompts, each step, graded as the step's
    assert [e["step"] for e in two.of("rollouts")] == [e["step"] for e in one.of("rollouts")] == sorted(want)
    for event in two.of("rollouts"):
        assert len(event["rollouts"]) == GROUP and len({r["prompt_index"] for r in event["rollouts"]}) == 1
        assert all(r["reward"] == float("e" in r["completion"].lower()) for r in event["rollouts"]), event
    return want


@pytest.mark.slow  # a torchrun launch of two ranks and a one-process run, 4 steps each: ~15 s
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("one_thread")  # the ranks run one thread each: the same arithmetic
def test_two_ranks_sample_and_train_as_one_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    one, two = _run_both(tmp_path, tiny_model_dir, "lora")
    _assert_same_steps(one, two, "ddp")
    mine, theirs = weights(layout.export_dir(two.out, "lora")), weights(layout.export_dir(tmp_path / "one" / "out", "lora"))
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.slow  # as above, full fine-tuning: ~20 s
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("one_thread")
def test_two_fsdp2_ranks_sample_in_lock_step_and_train_as_one_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Method full on two ranks is sharded with FSDP2: every forward gathers the layers with both
    ranks, so the rollouts decode in lock-step, the rank done first running idle forwards (its
    prompts' completions end at other steps than the other rank's: a group's longest completion
    sets how many forwards its rank runs). Same tolerances as under DDP."""
    one, two = _run_both(tmp_path, tiny_model_dir, "full")
    _assert_same_steps(one, two, "fsdp2")


class _Gather:
    """``Comm.gather_host`` of one process (``other`` None) or of rank 0 of two, rank 1 sending
    ``other``; keeps what this rank sent."""

    def __init__(self, other: list[float] | None = None) -> None:
        self.other, self.sent = other, None

    def gather_host(self, values: list[float], purpose: str = "") -> list[list[float]]:
        self.sent = list(values)
        return [self.sent] if self.other is None else [self.sent, self.other]


def _objective(scale: str) -> Grpo:
    objective = Grpo()
    objective.config = GrpoConfig(graders=GRADER, group_size=GROUP, max_new_tokens=NEW, scale_rewards=scale)
    return objective


def _items(rewards: list[list[float]]) -> list[PromptItem]:
    """Prompts whose completions scored ``rewards`` (a group each), completions of 1..G tokens."""
    items = [PromptItem(i, [1, 2, 3], {}, GROUP, NEW) for i in range(len(rewards))]
    for item, group in zip(items, rewards):
        item.rewards = list(group)
        item.completions = [[7] * (1 + k) for k in range(GROUP)]
    return items


def _sent(rewards: list[list[float]], scale: str) -> list[float]:
    """What a rank whose prompts scored ``rewards`` sends in ``_score``'s gather."""
    gather = _Gather()
    _objective(scale)._score(gather, _items(rewards))
    assert gather.sent is not None
    return gather.sent


REWARDS = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.25, 1.0, 0.0]]
"""A step's four groups: two on each rank."""


class TestScoring:
    """``Grpo._score`` (advantages and the step's completion tokens) with the gather of two ranks."""

    @pytest.mark.parametrize("scale", ["group", "batch", "none"])
    def test_each_rank_scores_its_prompts_as_one_process_scores_the_step(self, scale: str) -> None:
        whole, one = _items(REWARDS), _objective(scale)
        one._score(_Gather(), whole)
        first, second = _items(REWARDS[:2]), _items(REWARDS[2:])
        rank0, rank1 = _objective(scale), _objective(scale)
        rank0._score(_Gather(_sent(REWARDS[2:], scale)), first)
        rank1._score(_Gather(_sent(REWARDS[:2], scale)), second)  # the sums do not depend on the order
        for mine, theirs in zip(first + second, whole):
            assert mine.advantages == pytest.approx(theirs.advantages, rel=1e-6, abs=1e-7), scale
        assert rank0.step_tokens == rank1.step_tokens == one.step_tokens == 4 * (1 + 2 + 3 + 4)

    def test_batch_scale_divides_by_the_spread_of_the_whole_step(self) -> None:
        """TRL's ``scale_rewards='batch'``: the sample std of every reward of the step, what
        ``group_advantages`` computes given the step's rewards at once; not a group's own spread."""
        items = _items(REWARDS)
        _objective("batch")._score(_Gather(), items)
        rewards = torch.tensor([r for group in REWARDS for r in group])
        want, _ = group_advantages(rewards, GROUP, "batch")
        assert [a for item in items for a in item.advantages] == pytest.approx(want.tolist(), rel=1e-6, abs=1e-7)
        alone, _ = group_advantages(torch.tensor(REWARDS[0]), GROUP, "batch")
        assert not math.isclose(items[0].advantages[0], alone[0].item(), rel_tol=1e-3)


class TestStepFlops:
    def test_each_rank_counts_the_prompts_it_sampled_and_the_ranks_sum(self) -> None:
        """A rank's copies of the other ranks' prompts hold completions of an older step (or none):
        it counts its own prompts, and the gather adds the others'."""
        counter = FlopCounter(frozen_params=100, trainable_params=10)
        whole = _items(REWARDS)
        one = _objective("group")
        one.sampled, one.comm = whole, _Gather()
        # 4 prompts of 3 tokens, completions of 1-4: 88 tokens trained at 4 x 100 + 6 x 10 a token,
        # 52 fed to the sampler at 2 x 110
        assert one.step_flops(counter, whole) == 460 * 88 + 2 * 110 * 52
        rank1 = _objective("group")
        rank1.sampled, rank1.comm = whole[2:], _Gather()
        theirs = rank1.step_flops(counter, whole)
        seen_here = whole[:2] + [PromptItem(i, [1, 2, 3], {}, GROUP, NEW) for i in (2, 3)]  # never sampled here
        rank0 = _objective("group")
        rank0.sampled, rank0.comm = whole[:2], _Gather([theirs])
        assert rank0.step_flops(counter, seen_here) == one.step_flops(counter, whole)


class TestPack:
    def test_a_stand_in_packs_prompts_this_rank_never_sampled(self) -> None:
        """A rank with no micro-batch of its own packs the step's first as a stand-in (its loss
        times 0) whose prompts another rank sampled: a prompt never sampled here still packs ``G``
        sequences, one token after the prompt each, advantage 0 (never an empty row)."""
        batch = _objective("group").pack([PromptItem(0, [5, 6, 7], {}, GROUP, NEW)])
        assert batch.lengths == [4] * GROUP
        assert batch.input_ids[0, :4].tolist() == [5, 6, 7, 7]
        assert batch.targets[0, :4].tolist() == [-100, -100, 7, -100]
        assert batch.extras["advantage"].abs().sum().item() == 0.0
