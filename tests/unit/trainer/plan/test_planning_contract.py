"""The plan's contract: which decisions it makes, in which order, who applies each, and the plan
event's shape.

Every plan carries one decision per kernel choice (``attention``, ``loss``, ``lora_kernel``,
``fused_ops``), the multi-rank strategy (``parallelism``) and the activation policy
(``gradient_checkpointing``, requested as the job says), then one per switch of
``trainer.config.SWITCHES``, in that order; a switch's ``requested`` is the job's value, the
others' is ``auto``. ``Plan.to_dict`` is the plan
event (and ``detect --json``'s ``plan``): ``{device, dtype, model_attention, decisions: [{name,
requested, enabled, backend, reason}]}``, what the worker stores and the dashboard reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from plan_fakes import CPU, H100, plan_config
from trainer_helpers import Recorder, make_job

from trainer.config import SWITCHES, OptimConfig
from trainer.errors import PlanError
from trainer.features.attention import feature as attention
from trainer.features.checkpointing import policy as checkpointing
from trainer.features.lora_kernel import feature as lora_kernel
from trainer.features.moe import feature as moe
from trainer.features.offload import feature as offload
from trainer.features.registry import INSTALLED, PLANNED
from trainer.parallel import strategy as parallel
from trainer.plan import planner
from trainer.plan.feature import Context
from trainer.plan.types import Decision, ModelFacts
from trainer.plan.planner import plan
from trainer.training import install as install_module
from trainer.features.fused_ops import feature as fused_ops
from trainer.features.loss import feature as loss

KERNEL_CHOICES = ("attention", "loss", "lora_kernel", "fused_ops", parallel.NAME)
"""The decisions without a switch, in the plan's order (``requested`` is always ``auto``)."""
POLICY = checkpointing.NAME
"""The activation policy's decision, between the kernel choices and the switches."""
DECISION_FIELDS = {"name", "requested", "enabled", "backend", "reason"}
PLAN_FIELDS = {"device", "dtype", "model_attention", "decisions"}
RUN_FIELDS = {"hardware", "world_size", "total_steps", "model", "resumed_from_step"}
"""What the run's ``plan`` event adds to ``Plan.to_dict``."""
MOE_8B = ModelFacts(
    "qwen3_moe",
    is_moe=True,
    head_dim=128,
    num_layers=32,
    hidden_size=4096,
    param_count=8_000_000_000,
    moe_blocks=32,
    moe_family="qwen3_moe",
)


def _every_setting():
    """Each combination of auto/on/off over the switches, as keyword arguments of ``plan_config``."""
    for values in itertools.product(("auto", "on", "off"), repeat=len(SWITCHES)):
        yield dict(zip(SWITCHES, values, strict=True))


class TestDecisions:
    @pytest.mark.parametrize("hw", [CPU, H100], ids=["cpu", "h100"])
    def test_kernel_choices_then_one_per_switch_with_the_jobs_values(self, hw) -> None:
        planned = 0
        for switches in _every_setting():
            config = plan_config(**switches)
            try:
                p = plan(hw, config, MOE_8B)
            except PlanError:
                continue  # an impossible `on` here; its message is tested with the feature
            planned += 1
            assert [d.name for d in p.decisions] == [*KERNEL_CHOICES, POLICY, *SWITCHES]
            assert p.decision(POLICY).requested == config.gradient_checkpointing
            for name in SWITCHES:
                assert p.decision(name).requested == getattr(config.optimizations, name), name
            for name in KERNEL_CHOICES:
                assert p.decision(name).requested == "auto", name
        assert planned >= (16 if hw is CPU else 50), planned

    def test_every_decision_is_applied_by_its_feature(self) -> None:
        """A plan never claims what nothing installs: each decision is a feature's own (applied
        by ``trainer.training.install``), the strategy ``trainer.parallel.strategy.parallelize`` applies, or a
        partner whose choice the applied decision carries in its backend."""
        applied = {feature.name for feature in INSTALLED} | {parallel.NAME}
        partners = {"attention", offload.RELOAD}
        p = plan(H100, plan_config(offload_activations="on"), MOE_8B)
        assert {d.name for d in p.decisions} == applied | partners
        assert p.decision(attention.NAME).backend == p.attention_backend
        assert p.decision(offload.NAME).backend == p.decision(offload.RELOAD).backend == "double"
        p = plan(H100, plan_config(offload_activations="on", double_buffered_reload="off"), MOE_8B)
        assert p.decision(offload.NAME).backend == p.decision(offload.RELOAD).backend == "sync"


    def test_every_planned_feature_decides_its_own_decision_once(self) -> None:
        names = [feature.name for feature in PLANNED]
        assert len(names) == len(set(names)), names
        assert {feature.name for feature in INSTALLED} <= set(names)
        assert set(SWITCHES) <= set(names)

    def test_a_feature_added_to_the_registry_is_decided_in_its_place(self, monkeypatch) -> None:
        """``plan`` iterates the registry: a new feature is one entry there, it reads the decisions
        made before it from its ``Context``, and lands among the non-switch decisions."""
        seen: list[Context] = []

        class Toy:
            name = "toy"

            def supported(self, ctx: Context) -> str | None:
                return None

            def decide(self, ctx: Context) -> Decision:
                seen.append(ctx)
                kernel = ctx.decision("attention")
                return Decision(self.name, "auto", kernel.enabled, kernel.backend, "test: follows the kernel")

        monkeypatch.setattr(planner, "PLANNED", (*PLANNED[:1], Toy(), *PLANNED[1:]))
        p = plan(CPU, plan_config(), MOE_8B)
        assert [d.name for d in p.decisions] == ["attention", "toy", *KERNEL_CHOICES[1:], POLICY, *SWITCHES]
        assert p.decision("toy").backend == p.attention_backend
        (ctx,) = seen
        assert [d.name for d in ctx.decided] == ["attention"] and ctx.facts is MOE_8B


class _Recorded:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def remove(self) -> None:
        self.log.append(f"remove {self.name}")

    def describe(self) -> str:
        return self.name


class TestInstall:
    def _record_applies(self, monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> list[str]:
        log: list[str] = []
        for feature in INSTALLED:

            def fake_apply(model, decision, *args, _name=feature.name, **kwargs):
                assert decision.name == _name, f"{_name} was handed the {decision.name} decision"
                if _name == fail:
                    raise RuntimeError(f"{_name} failed")
                log.append(f"apply {_name}")
                return _Recorded(log, _name)

            monkeypatch.setattr(feature, "apply", fake_apply)
        return log

    def test_each_feature_gets_its_own_decision_and_remove_runs_in_reverse(self, monkeypatch) -> None:
        log = self._record_applies(monkeypatch)
        installed = install_module.install(object(), plan(CPU, plan_config(), MOE_8B))
        order = [attention.NAME, moe.NAME, POLICY, offload.NAME, lora_kernel.NAME, fused_ops.NAME, loss.NAME]
        assert log == [f"apply {name}" for name in order]
        assert installed.describe() == order
        installed.remove()
        assert log[len(order):] == [f"remove {name}" for name in reversed(order)]
        installed.remove()  # once only
        assert len(log) == 2 * len(order)

    def test_a_failed_install_removes_what_it_had_applied(self, monkeypatch) -> None:
        log = self._record_applies(monkeypatch, fail=lora_kernel.NAME)
        with pytest.raises(RuntimeError, match="lora_kernel failed"):
            install_module.install(object(), plan(CPU, plan_config(), MOE_8B))
        done = [attention.NAME, moe.NAME, POLICY, offload.NAME]
        assert log == [f"apply {n}" for n in done] + [f"remove {n}" for n in reversed(done)]


class TestPlanEvent:
    @pytest.mark.parametrize("hw", [CPU, H100], ids=["cpu", "h100"])
    def test_to_dict_is_the_agreed_shape(self, hw) -> None:
        p = plan(hw, plan_config(), MOE_8B)
        event = p.to_dict()
        assert set(event) == PLAN_FIELDS
        assert (event["device"], event["dtype"], event["model_attention"]) == (p.device, p.dtype, p.hf_attention)
        assert event["decisions"] == [dataclasses.asdict(d) for d in p.decisions]
        for d in event["decisions"]:
            assert set(d) == DECISION_FIELDS, d["name"]
            assert isinstance(d["enabled"], bool) and isinstance(d["reason"], str) and d["reason"]
            assert d["requested"] in ("auto", "on", "off", "selective")
            assert d["backend"] is None or isinstance(d["backend"], str)
        assert json.loads(json.dumps(event)) == event

    @pytest.mark.slow  # a real one-step run: ~6 s cold on 2 cores
    def test_the_run_emits_it_with_the_run_fields(
        self, tmp_path: Path, tiny_model_dir: Path, one_thread: None
    ) -> None:
        from trainer.training.train import run

        events = Recorder()
        result = run(make_job(tmp_path, tiny_model_dir, optim=OptimConfig(max_steps=1)), events)
        assert result.status == "succeeded", result.message
        (event,) = events.of("plan")
        assert set(event) == {"type", "time"} | PLAN_FIELDS | RUN_FIELDS
        assert [d["name"] for d in event["decisions"]] == [*KERNEL_CHOICES, POLICY, *SWITCHES]
        assert all(set(d) == DECISION_FIELDS for d in event["decisions"])


class TestAcrossMachines:
    """A run torchrun spreads over several machines (GROUP_WORLD_SIZE > 1) must not shard unless
    its checkpoints go to a directory they all share (``shared_checkpoint_dir``): else each machine
    would keep its own pieces of every checkpoint on a disk no other machine reads."""

    def test_sharding_over_two_machines_is_refused_saying_why(self, monkeypatch):
        monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
        with pytest.raises(PlanError, match="spans 2 machines and would shard"):
            plan(H100, plan_config(method="full"), world_size=2)

    def test_sharding_over_machines_sharing_a_checkpoint_directory_is_planned(self, monkeypatch):
        monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
        config = plan_config(method="full", shared_checkpoint_dir="/shared/jobs/j")
        assert plan(H100, config, world_size=2).decision("parallelism").backend == "fsdp2"

    def test_a_shared_checkpoint_directory_must_be_absolute(self):
        with pytest.raises(ValueError, match="shared_checkpoint_dir: must be an absolute path"):
            plan_config(method="full", shared_checkpoint_dir="shared/jobs/j")

    def test_adapters_over_two_machines_and_sharding_on_one_are_planned(self, monkeypatch):
        monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
        assert plan(H100, plan_config(method="lora"), world_size=2).decision("parallelism").backend == "ddp"
        monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
        assert plan(H100, plan_config(method="full"), world_size=2).decision("parallelism").backend == "fsdp2"
