"""Guards in the loop: a non-finite step is never applied, too many in a row fail ``non_finite``
with the last good checkpoint resumable; eval loss and greedy samples at checkpoints and at the end."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from trainer_helpers import Recorder, make_job, write_jsonl

from tests.poison import poison_model, records, seed_with_order
from trainer.training import guards
from trainer.config import DataConfig, OptimConfig
from trainer.training.train import run

pytestmark = pytest.mark.usefixtures("one_thread")


def _adapter(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(path) / "adapter_model.safetensors")


class TestArm:
    @pytest.mark.parametrize("bad", [float("nan"), float("inf")])
    def test_a_fused_optimizer_skips_on_the_device_flag(self, bad: float) -> None:
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, fused=True)
        param.grad = torch.full((3,), bad)
        assert guards.arm(optimizer, torch.tensor(bad), torch.tensor(1.0)) is True
        optimizer.step()
        assert torch.equal(param.detach(), torch.ones(3))
        assert torch.count_nonzero(optimizer.state[param]["exp_avg"]) == 0
        assert optimizer.state[param]["step"].item() == 0
        param.grad = torch.ones(3)
        assert guards.arm(optimizer, torch.tensor(0.5), torch.tensor(1.0)) is True
        optimizer.step()
        assert param.detach()[0].item() < 1.0 and optimizer.state[param]["step"].item() == 1

    def test_a_foreach_optimizer_is_told_to_skip_by_the_host(self) -> None:
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([param], lr=0.1)
        assert guards.arm(optimizer, torch.tensor(1.0), torch.tensor(float("nan"))) is False
        assert guards.arm(optimizer, torch.tensor(1.0), torch.tensor(2.0)) is True


class TestNonFiniteGuard:
    def test_a_streak_resets_on_a_finite_step_and_fails_at_the_limit_naming_its_first_step(self) -> None:
        emitted: list[tuple[str, dict]] = []
        guard = guards.NonFiniteGuard(limit=2)
        emit = lambda type_, **kw: emitted.append((type_, kw))
        guard.check({"step": 1, "loss": float("nan"), "grad_norm": 1.0}, emit, 0)
        guard.check({"step": 2, "loss": 1.0, "grad_norm": 1.0}, emit, 0)
        guard.check({"step": 3, "loss": 1.0, "grad_norm": float("inf")}, emit, 2)
        with pytest.raises(guards.NonFiniteError, match=r"^step 3: .* up to step 4 .*checkpoint \(step 2\)"):
            guard.check({"step": 4, "loss": float("nan"), "grad_norm": float("nan")}, emit, 2)
        assert [(kw["step"], kw["consecutive"], kw["first_step"]) for _, kw in emitted] == [(1, 1, 1), (3, 1, 3), (4, 2, 3)]
        assert guards.NonFiniteError("x").code == "non_finite"


@pytest.mark.slow  # ~10 s: three short CPU runs of the tiny Llama
class TestNonFiniteRun:
    def test_poisoned_steps_are_skipped_then_fail_non_finite_and_the_last_checkpoint_resumes(
        self, tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        poisoned = tmp_path / "poisoned"
        poison_model(tiny_model_dir, poisoned)
        pattern = "ccppcc"
        seed = seed_with_order(pattern, "ccpp", 64)
        train = write_jsonl(tmp_path / "poisoned.jsonl", records(pattern))
        config = make_job(tmp_path, poisoned, data=DataConfig(str(train), max_seq_len=64, batch_tokens=64),
                          optim=OptimConfig(max_steps=6, learning_rate=1e-2), seed=seed, checkpoint_every=1,
                          max_non_finite_steps=2)
        events = Recorder()
        result = run(config, events)

        assert (result.status, result.error_code) == ("failed", "non_finite")
        assert result.message.startswith("step 3: ") and "max_non_finite_steps=2" in result.message
        skips = events.of("skip")
        assert [(e["step"], e["consecutive"]) for e in skips] == [(3, 1), (4, 2)]
        losses = {e["step"]: e["loss"] for e in events.of("step")}
        assert math.isfinite(losses[1]) and math.isfinite(losses[2]) and math.isnan(losses[3])
        checkpoints = [e["step"] for e in events.of("checkpoint")]
        assert checkpoints == [1, 2, 3], "no checkpoint is written once the limit is reached"
        # step 3 was not applied: its checkpoint holds step 2's weights, all finite
        step2, step3 = (_adapter(e["path"]) for e in events.of("checkpoint")[1:])
        assert all(torch.isfinite(t).all() and torch.equal(t, step2[k]) for k, t in step3.items())

        resumed = Recorder()
        again = run(dataclasses.replace(config, model=dataclasses.replace(config.model, name_or_path=str(tiny_model_dir))),
                    resumed)
        assert again.status == "succeeded", again.message
        assert resumed.of("plan")[0]["resumed_from_step"] == 3
        assert [e["step"] for e in resumed.of("step")] == [4, 5, 6]
        assert all(math.isfinite(e["loss"]) for e in resumed.of("step"))


@pytest.mark.slow  # ~5 s: one short CPU run with validation and generations
class TestEvaluationAndSamples:
    def test_eval_every_and_at_the_end_samples_at_checkpoints(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        val = write_jsonl(tmp_path / "val.jsonl", [
            {"messages": [{"role": "user", "content": "What is 2 plus one?"},
                          {"role": "assistant", "content": "The answer is 3."}]}])
        base = make_job(tmp_path, tiny_model_dir)
        config = dataclasses.replace(
            base, data=dataclasses.replace(base.data, validation_path=str(val)),
            optim=OptimConfig(max_steps=5, learning_rate=1e-2), checkpoint_every=3, eval_every=2,
            sample_prompts=("What is 4 plus one?",), sample_max_new_tokens=6)
        events = Recorder()
        assert run(config, events).status == "succeeded"
        assert [e["step"] for e in events.of("eval")] == [2, 4, 5]
        assert all(math.isfinite(e["loss"]) and e["tokens"] > 0 for e in events.of("eval"))
        samples = events.of("sample")
        assert [(e["step"], e["final"]) for e in samples] == [(3, False), (5, True)]
        [one] = samples[-1]["samples"]
        assert one["prompt"] == "What is 4 plus one?" and 0 < one["tokens"] <= 6 and one["completion"]

    def test_sample_count_takes_prompts_from_the_validation_set(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        val = write_jsonl(tmp_path / "val.jsonl", [
            {"messages": [{"role": "user", "content": f"What is {i} plus one?"},
                          {"role": "assistant", "content": f"The answer is {i + 1}."}]} for i in range(3)])
        base = make_job(tmp_path, tiny_model_dir)
        config = dataclasses.replace(
            base, data=dataclasses.replace(base.data, validation_path=str(val)),
            optim=OptimConfig(max_steps=2, learning_rate=1e-2), sample_count=2, sample_max_new_tokens=3)
        events = Recorder()
        assert run(config, events).status == "succeeded"
        [sample] = events.of("sample")
        assert [s["prompt"] for s in sample["samples"]] == ["What is 0 plus one?", "What is 1 plus one?"]
