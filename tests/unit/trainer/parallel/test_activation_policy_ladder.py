"""The OOM ladder (``trainer.parallel.oom_ladder``): an out-of-memory error in the first steps steps the
activation policy down and retries the same step on the same data.

The OOM comes from a real code path: ``FTQ_TEST_ACTIVATION_BUDGET_BYTES`` arms the activation
policy's budget probe, which raises ``torch.OutOfMemoryError`` when the decoder layers save more
than the budget for backward in one forward. The budget is what full checkpointing saves, the
two layers' inputs at the 256-token batch budget (2 x 256 x 64 x 4 bytes): keeping every
activation and checkpointing half the layers both run out, full checkpointing fits. The run must say so in its events and follow an uninterrupted full-checkpointing run
exactly (same losses, same trained weights: tolerance 0).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from plan_fakes import CPU, H100, plan_config
from trainer_helpers import Recorder, lora_model, train_lora

from trainer.errors import error_code
from trainer.features.checkpointing import policy as checkpointing
from trainer.features.checkpointing.policy import BUDGET_ENV
from trainer.training.install import install
from trainer.parallel.oom_ladder import ADVICE, Ladder
from trainer.plan.planner import plan

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]
FULL_CHECKPOINTING_BYTES = 2 * 256 * 64 * 4
"""Layers x batch_tokens (``make_job``) x hidden (``trainer.model.tiny``) x fp32."""


@pytest.mark.slow  # two real runs of 3 steps: ~3 s
def test_an_oom_steps_down_and_follows_the_full_checkpointing_run(tmp_path, tiny_model_dir, monkeypatch) -> None:
    reference, ref_weights = train_lora(tmp_path / "full", tiny_model_dir, monkeypatch, steps=3,
                                        gradient_checkpointing="on")
    monkeypatch.setenv(BUDGET_ENV, str(FULL_CHECKPOINTING_BYTES))
    laddered, weights = train_lora(tmp_path / "ladder", tiny_model_dir, monkeypatch, steps=3,
                                   gradient_checkpointing="off")
    (policy,) = [d for d in laddered.of("plan")[0]["decisions"] if d["name"] == checkpointing.NAME]
    assert policy["backend"] == "none"
    warnings = [e["message"] for e in laddered.of("log") if e["level"] == "warning"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("out of memory at step 1 with activation policy none (test budget")
    assert "stepped down to selective:1/2" in warnings[0] and "retrying step 1 on the same data" in warnings[0]
    assert "with activation policy selective:1/2" in warnings[1] and "stepped down to full" in warnings[1]
    steps = laddered.of("step")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference.of("step")]
    assert [s["tokens"] for s in steps] == [s["tokens"] for s in reference.of("step")]
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, ref_weights[name]), name


class TestLadder:
    def _ladder(self) -> tuple[Ladder, list[str], torch.optim.Optimizer]:
        model = lora_model("llama")
        base = plan(CPU, plan_config(gradient_checkpointing="off"))
        installed = install(model, base)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        logs: list[str] = []
        ladder = Ladder(installed, optimizer, torch.device("cpu"), CPU, lambda m, level: logs.append(m))
        return ladder, logs, optimizer

    @pytest.mark.parametrize(("hw", "bottom"), [(CPU, ["full"]), (H100, ["full", "full+offload"])], ids=["cpu", "h100"])
    def test_the_rungs_of_a_32_layer_model(self, hw, bottom) -> None:
        """Selective rungs checkpoint half the layers still kept; offload only where it can run."""
        installed = SimpleNamespace(checkpointing=SimpleNamespace(layers=[None] * 32))
        ladder = Ladder(installed, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), torch.device("cpu"), hw,
                        lambda m, level: None)
        current = checkpointing.with_policy(plan(CPU, plan_config()), "none", "test")
        rungs = []
        while (current := ladder.next_plan(current)) is not None:
            rungs.append(current.decision(checkpointing.NAME).backend)
        expected = [f"selective:{n}/32" for n in (16, 24, 28, 30, 31)] + bottom
        assert rungs == expected
        if hw is H100:
            offloaded = ladder.next_plan(checkpointing.with_policy(plan(CPU, plan_config()), "full", "test"))
            assert (offloaded.decision("offload_activations").enabled, offloaded.decision("offload_activations").backend) == (True, "sync")

    def test_the_bottom_fails_out_of_memory_with_advice(self) -> None:
        ladder, logs, _ = self._ladder()

        def always() -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        with pytest.raises(torch.OutOfMemoryError) as caught:
            ladder.run(1, always)
        assert len(logs) == 2  # none -> selective -> full; no offload on a CPU
        assert "lowest activation policy here (full)" in str(caught.value) and ADVICE in str(caught.value)
        assert error_code(caught.value) == "out_of_memory"
        assert ladder.installed.plan.decision(checkpointing.NAME).backend == "full"

    def test_an_oom_inside_the_optimizer_step_is_not_retried(self) -> None:
        ladder, logs, optimizer = self._ladder()

        def state_then_oom() -> None:
            optimizer.state[optimizer.param_groups[0]["params"][0]]["step"] = torch.tensor(0.0)
            raise torch.OutOfMemoryError("out of memory")

        with pytest.raises(torch.OutOfMemoryError, match="in the optimizer step of step 1"):
            ladder.run(1, state_then_oom)
        assert logs == []

    def test_after_a_checkpoint_an_oom_is_not_caught(self) -> None:
        ladder, logs, _ = self._ladder()
        ladder.close()

        def oom() -> None:
            raise torch.OutOfMemoryError("out of memory")

        with pytest.raises(torch.OutOfMemoryError, match="^out of memory$"):
            ladder.run(1, oom)
        assert logs == []
