"""The ``grpo`` objective end to end on CPU: a tiny random-weight Llama learns what its grader pays for.

The reward is a ``string_check`` grader: 1 when the completion (8 new tokens) contains the record's
``target`` (``{{item.target}}``, the one-token word " the"), else 0. The base model writes it in a
few % of its completions, so a group has a signal now and then, and the run must raise the reward
mean from the first step's to 0.9 over the last 4 of 30 steps (4 prompts x 8 completions a step).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_helpers import Recorder, make_job, write_jsonl
from transformers import AutoTokenizer

from trainer.config import DataConfig, LoraConfig, OptimConfig
from trainer.errors import ConfigError
from trainer.objectives.grpo_config import GrpoConfig
from trainer.training.train import StopFlag, run

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
PROMPTS = ("The cat", "A dog", "Hello", "Once upon")
GROUP, NEW, STEPS = 8, 8, 30
TARGET = " the"
"""One token of the tiny tokenizer (id 264): the base model writes it in ~3% of 8-token completions."""
GRADER = {"type": "string_check", "name": "says the", "input": "{{sample.output_text}}",
          "reference": "{{item.target}}", "operation": "like"}
HAS_AN_E = {"type": "string_check", "name": "has an e", "input": "{{sample.output_text}}", "reference": "e",
            "operation": "ilike"}


def _job(tmp_path, model_dir, **grpo):
    records = [{"prompt": p, "target": TARGET} for p in PROMPTS]
    train = write_jsonl(tmp_path / "prompts.jsonl", records)
    # full fine-tuning: the tiny model's frozen, tied head under a LoRA caps any token near 1%
    return make_job(tmp_path, model_dir, objective="grpo", method="full",
                    data=DataConfig(str(train), max_seq_len=64, batch_tokens=4 * GROUP * 16),
                    optim=OptimConfig(max_steps=STEPS, learning_rate=1e-2, warmup_steps=1),
                    grpo=GrpoConfig(graders=GRADER, group_size=GROUP, max_new_tokens=NEW, **grpo))


@pytest.mark.slow  # 30 steps of 32 rollouts of 8 tokens and a full fine-tuning step each: ~40 s
def test_a_tiny_model_learns_what_the_grader_pays_for(tmp_path, tiny_model_dir) -> None:
    recorder = Recorder()
    result = run(_job(tmp_path, tiny_model_dir, loss_type="grpo"), recorder)
    assert result.status == "succeeded", recorder.of("done")
    steps = recorder.of("step")
    rewards = [s["reward_mean"] for s in steps]
    assert len(steps) == STEPS and all(s["completion_length"] <= NEW for s in steps)
    assert rewards[0] < 0.2, rewards  # the base: " the" in ~3% of completions
    assert sum(rewards[-4:]) / 4 >= 0.9, rewards  # measured: 1.0 from step 19 (lr 1e-2)
    assert all(s["grade_error_fraction"] == 0 for s in steps)
    prompt_tokens = sum(len(AutoTokenizer.from_pretrained(tiny_model_dir)(p)["input_ids"]) for p in PROMPTS)
    for s in steps:  # every prompt every step: the sampled sequences, not the packed budget
        assert s["tokens"] == GROUP * prompt_tokens + round(s["completion_length"] * GROUP * len(PROMPTS)), s


def test_a_job_without_a_grader_is_refused_naming_the_field(tmp_path, tiny_model_dir) -> None:
    config = dataclasses.replace(_job(tmp_path, tiny_model_dir), grpo=GrpoConfig(group_size=GROUP))
    recorder = Recorder()
    result = run(config, recorder)
    assert result.status == "failed"
    assert recorder.of("done")[0]["message"].startswith("grpo.graders: a GRPO job needs a grader"), recorder.of("done")


def test_a_group_longer_than_batch_tokens_is_refused_at_the_start(tmp_path, tiny_model_dir) -> None:
    config = _job(tmp_path, tiny_model_dir)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_tokens=64))
    recorder = Recorder()
    assert run(config, recorder).status == "failed"
    message = recorder.of("done")[0]["message"]
    assert message.startswith("data.batch_tokens: prompt ") and "8 prompt + 8 x (1 + 8 new) = 80 tokens" in message, \
        message


def test_without_shared_prefixes_the_whole_group_must_fit(tmp_path, tiny_model_dir) -> None:
    """``packed_metadata_cache: off`` rebuilds the boundaries from positions in every layer, which
    cannot express a shared prefix: the groups pack as whole sequences, and a ``batch_tokens`` that
    fits only the shared layout is refused at the start, naming the whole group's size."""
    from trainer.config import Optimizations

    config = _job(tmp_path, tiny_model_dir)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_tokens=100),
                                 optimizations=Optimizations(packed_metadata_cache="off"))
    recorder = Recorder()
    assert run(config, recorder).status == "failed"
    message = recorder.of("done")[0]["message"]
    assert message.startswith("data.batch_tokens: prompt ") and "8 x (9 prompt + 8 new) = 136 tokens" in message, message


def test_a_record_the_grader_cannot_read_scores_0_as_a_grader_error(tmp_path, tiny_model_dir) -> None:
    """Only the first records are dry-run at submission: a later one without the field the
    template names fails its completions (reward 0, counted) and the run goes on."""
    config = _job(tmp_path, tiny_model_dir)
    records = [{"prompt": p, "target": TARGET} for p in PROMPTS[:3]] + [{"prompt": PROMPTS[3]}]
    write_jsonl(tmp_path / "prompts.jsonl", records)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_steps=1))
    recorder = Recorder()
    assert run(config, recorder).status == "succeeded", recorder.of("done")
    [step] = recorder.of("step")
    assert step["grade_error_fraction"] == pytest.approx(0.25), step  # 1 prompt of 4, all its completions
    [shown] = recorder.of("rollouts")  # grpo.log_rollouts: 4 by default, the first prompt's first completions
    assert shown["step"] == 1 and len(shown["rollouts"]) == 4
    assert recorder.events.index(shown) == recorder.events.index(step) + 1  # right after its step
    assert len({r["prompt_index"] for r in shown["rollouts"]}) == 1
    for rollout in shown["rollouts"]:
        assert rollout["prompt"] == PROMPTS[rollout["prompt_index"]]  # decoded, special tokens left out
        assert rollout["reward"] == float(TARGET in rollout["completion"]), rollout
        assert rollout["scores"] == {"says the": rollout["reward"]} and 1 <= rollout["completion_tokens"] <= NEW


def test_rollouts_shown_span_prompts_and_zero_shows_none(tmp_path, tiny_model_dir) -> None:
    """``grpo.log_rollouts`` 10 with groups of 8: the step's first prompt's 8 completions, then the
    second's first 2 (in the step's order of prompts); their advantages are the group's (mean 0 over a whole group). 0 emits no event."""
    config = _job(tmp_path, tiny_model_dir, log_rollouts=10)
    config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_steps=1))
    recorder = Recorder()
    assert run(config, recorder).status == "succeeded", recorder.of("done")
    [shown] = recorder.of("rollouts")
    first, second = shown["rollouts"][0]["prompt_index"], shown["rollouts"][-1]["prompt_index"]
    assert first != second and [r["prompt_index"] for r in shown["rollouts"]] == [first] * GROUP + [second] * 2
    assert sum(r["advantage"] for r in shown["rollouts"][:GROUP]) == pytest.approx(0.0, abs=1e-5)
    [step] = recorder.of("step")
    assert step["reward_mean"] * len(PROMPTS) * GROUP >= sum(r["reward"] for r in shown["rollouts"])
    none = dataclasses.replace(config, grpo=dataclasses.replace(config.grpo, log_rollouts=0),
                               output_dir=str(tmp_path / "none"))
    recorder = Recorder()
    assert run(none, recorder).status == "succeeded" and not recorder.of("rollouts")


def test_bad_settings_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="grpo.group_size: must be an integer >= 2"):
        GrpoConfig(group_size=1)
    with pytest.raises(ValueError, match="grpo.temperature: must be a number > 0"):
        GrpoConfig(temperature=0.0)
    with pytest.raises(ValueError, match=r"grpo.log_rollouts: must be an integer in \[0, 64\]"):
        GrpoConfig(log_rollouts=65)
    assert issubclass(ConfigError, Exception)


class _StopAfter(Recorder):
    """A recorder that asks the run to stop once ``step``'s event is out (a cancel)."""

    def __init__(self, step: int, stop: StopFlag) -> None:
        super().__init__()
        self.step, self.stop = step, stop

    def __call__(self, type_: str, **payload: object) -> dict:
        event = super().__call__(type_, **payload)
        if type_ == "step" and payload["step"] == self.step:
            self.stop.set("test stop")
        return event


def _resumable(tmp_path, model_dir):
    tmp_path.mkdir()
    records = [{"prompt": p, "target": TARGET} for p in PROMPTS[:2]]
    train = write_jsonl(tmp_path / "prompts.jsonl", records)
    return make_job(tmp_path, model_dir, objective="grpo", lora=LoraConfig(r=8, alpha=16), checkpoint_every=2,
                    data=DataConfig(str(train), max_seq_len=64, batch_tokens=2 * 4 * 16),
                    optim=OptimConfig(max_steps=4, learning_rate=1e-2),
                    grpo=GrpoConfig(graders={**GRADER, "operation": "ilike", "reference": "e"}, group_size=4,
                                    max_new_tokens=6, loss_type="grpo"))


@pytest.mark.slow  # two runs of 4 steps of 8 rollouts: ~10 s
def test_a_resumed_run_samples_and_trains_as_an_uninterrupted_one(tmp_path, tiny_model_dir) -> None:
    """Stopped after step 2 (its checkpoint) and resumed, steps 3-4 regenerate the same rollouts
    (their seeds come from the job's seed, the step and the prompt), so rewards, completion lengths
    and losses equal the uninterrupted run's."""
    straight = Recorder()
    assert run(_resumable(tmp_path / "a", tiny_model_dir), straight).status == "succeeded"
    split, stop = _resumable(tmp_path / "b", tiny_model_dir), StopFlag()
    first = _StopAfter(2, stop)
    assert run(split, first, stop).status == "cancelled"
    second = Recorder()
    assert run(split, second).status == "succeeded"
    assert second.of("plan")[0]["resumed_from_step"] == 2
    resumed = first.of("step") + second.of("step")
    assert [e["step"] for e in resumed] == [1, 2, 3, 4]
    for key in ("reward_mean", "reward_std", "completion_length", "zero_std_fraction"):
        assert [e[key] for e in resumed] == [e[key] for e in straight.of("step")], key
    assert [e["loss"] for e in resumed] == pytest.approx([e["loss"] for e in straight.of("step")], rel=1e-5)
    assert len({e["reward_std"] for e in straight.of("step")}) > 1  # the rollouts differ from step to step
    shown = [(e["step"], e["rollouts"]) for e in first.of("rollouts") + second.of("rollouts")]
    assert shown == [(e["step"], e["rollouts"]) for e in straight.of("rollouts")]  # the same texts and rewards


@pytest.mark.slow  # two runs of 2 steps of 32 rollouts: ~10 s
def test_rollouts_with_shared_prompts_are_those_of_the_unshared_cache(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """``Grpo.share_prompts`` on and off: the same sampled (temperature 1, seeded) completions, rewards
    and losses over 2 full fine-tuning steps (the second samples the trained model). 12 slots for 32
    sequences, so slots are refilled and groups split across steps; the unshared run copied each
    group's prompt into its choices' slots, the shared one copied none."""
    from trainer.generate import cache as sampler_cache
    from trainer.objectives import grpo as grpo_objective
    from trainer.objectives import grpo_slots

    monkeypatch.setattr(grpo_slots, "CPU_SLOTS", 12)
    copies: list[int] = []
    copy_prefix = sampler_cache.KVCache.copy_prefix
    monkeypatch.setattr(sampler_cache.KVCache, "copy_prefix",
                        lambda self, *a: copies.append(1) or copy_prefix(self, *a))
    runs = []
    for shared in (False, True):
        monkeypatch.setattr(grpo_objective.Grpo, "share_prompts", shared)
        copies.clear()
        (tmp_path / str(shared)).mkdir()
        config = _job(tmp_path / str(shared), tiny_model_dir, log_rollouts=64)
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_steps=2))
        recorder = Recorder()
        assert run(config, recorder).status == "succeeded", recorder.of("done")
        runs.append((recorder, len(copies)))
    (unshared, copied), (shared_run, copied_shared) = runs
    assert copied > 0 and copied_shared == 0
    assert [e["rollouts"] for e in shared_run.of("rollouts")] == [e["rollouts"] for e in unshared.of("rollouts")]
    assert len({r["completion"] for e in unshared.of("rollouts") for r in e["rollouts"]}) > GROUP  # choices differ
    for key in ("reward_mean", "reward_std", "completion_length", "loss"):
        assert [e[key] for e in shared_run.of("step")] == [e[key] for e in unshared.of("step")], key


class TestRolloutSlots:
    """``rollout_slots``'s arithmetic (``fit_slots``): the most slots whose cache fits the room."""

    def test_the_most_slots_and_their_prompt_slots_that_fit(self) -> None:
        from trainer.objectives.grpo_slots import fit_slots, prompt_slots_for

        # 8 slots of 10 bytes + 2 prompt slots per group of 4 (4) of 5 bytes: 100; a 9th slot needs 120
        assert fit_slots(100, 100, 4, 10, 5) == (8, 4)
        assert fit_slots(100, 5, 4, 10, 5) == (5, 4)  # all 5 sequences fit: 50 + 4 x 5
        assert fit_slots(3, 100, 4, 10, 5) == (1, 1)  # at least one
        assert fit_slots(100, 100, 4, 10, 0) == (10, 0)  # no prompt store: the unshared layout
        assert prompt_slots_for(3, 8) == 2 and prompt_slots_for(1, 8) == 1 and prompt_slots_for(17, 8) == 6

    def test_an_8b_grpo_step_within_trls_peak_decodes_in_two_waves_with_shared_prompts(self) -> None:
        """docs/benchmarks.md's case: Llama-3.1-8B shape in bf16 (32 layers, 8 kv heads of 128, vocab
        128,256), 39.95 GiB cap, 15.6 GiB held, 64 prompts of 256 tokens x 8, 512 new tokens."""
        from trainer.objectives.grpo_slots import fit_slots
        from trainer.plan.memory import margin

        gib = 2**30
        cap = int(39.95 * gib)
        room = cap - int(15.6 * gib) - margin(cap)
        position, logits = 2 * 32 * 8 * 128 * 2, 3 * 128_256 * 4
        unshared = fit_slots(room, 512, 8, 768 * position + logits, 0)
        shared = fit_slots(room, 512, 8, 512 * position + logits, 256 * position)
        assert unshared == (222, 0)  # 3 waves (222, 222, 68), as measured
        assert shared == (294, 74) and -(-512 // shared[0]) == 2


@pytest.mark.slow  # two runs of 2 steps of 32 rollouts: ~10 s
def test_training_each_prompt_once_per_group_gives_the_losses_of_whole_sequences(
        tmp_path, tiny_model_dir, monkeypatch) -> None:
    """``Grpo.share_prefixes`` on and off (packed SDPA attention on CPU takes shared prefixes): the
    same rollouts, rewards and step tokens, and losses within fp32 rounding over 2 full fine-tuning
    steps (the second samples the model the first trained, so its gradients matched too); the
    shared run packed every micro-batch with prefixes and fewer tokens."""
    from trainer.objectives import grpo as grpo_objective

    pack = grpo_objective.Grpo.pack
    runs = []
    for shared in (False, True):
        packed: list[tuple[bool, int]] = []
        monkeypatch.setattr(grpo_objective.Grpo, "share_prefixes", shared)
        monkeypatch.setattr(grpo_objective.Grpo, "pack", lambda self, items: (
            batch := pack(self, items), packed.append((batch.prefixes is not None, batch.num_tokens)))[0])
        (tmp_path / str(shared)).mkdir()
        config = _job(tmp_path / str(shared), tiny_model_dir, log_rollouts=64)
        # a reward most groups spread over (an "e" in the text), so the gradients are not 0
        config = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_steps=2),
                                     grpo=dataclasses.replace(config.grpo, graders=HAS_AN_E))
        recorder = Recorder()
        assert run(config, recorder).status == "succeeded", recorder.of("done")
        runs.append((recorder, packed))
    (whole, whole_packed), (shared_run, shared_packed) = runs
    assert not any(p for p, _ in whole_packed) and all(p for p, _ in shared_packed)
    assert sum(n for _, n in shared_packed) < sum(n for _, n in whole_packed)
    assert [e["rollouts"] for e in shared_run.of("rollouts")] == [e["rollouts"] for e in whole.of("rollouts")]
    for key in ("reward_mean", "reward_std", "completion_length", "tokens"):
        assert [e[key] for e in shared_run.of("step")] == [e[key] for e in whole.of("step")], key
    # with ratio 1 the loss is minus the advantages' mean (near 0): the gradient norm is the measure
    assert [e["loss"] for e in shared_run.of("step")] == pytest.approx([e["loss"] for e in whole.of("step")],
                                                                        abs=1e-6)
    norms = [e["grad_norm"] for e in whole.of("step")]
    assert min(norms) > 1e-3 and [e["grad_norm"] for e in shared_run.of("step")] == pytest.approx(norms, rel=1e-5)
