"""bench.plans and bench.train_step's variants on the CPU: every ftq variant is a plan.

A tiny random Llama (and GPT-OSS) from ``bench.workload``; the facts are read from the built
model's own config as the trainer reads a checkpoint's; each variant's plan differs from the
all-``auto`` plan in exactly its switches or kernel choices; installing a variant and removing
it leaves the model computing what it computed before, bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator

import pytest
import torch

from bench.ablation import TINY_GPT_OSS, TINY_LLAMA
from bench.plans import CPU_OFFLOAD, KERNELS_OFF, Planner, bench_config, bench_facts, changes, variant_plan
from bench.train_step import RECIPES, VARIANTS, Variant, run_variant_cpu
from bench.workload import build_lora_model, packed_batch, packed_steps
from trainer.plan.hardware import detect
from trainer.plan.planner import plan

CPU = torch.device("cpu")
# peft 0.21 still reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny CPU matmuls: one torch thread skips the hand-offs, and sums in one order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama():
    model, optimizer = build_lora_model(TINY_LLAMA, CPU)
    return model, optimizer


@pytest.fixture(scope="module")
def planner(llama) -> Planner:
    return Planner.for_model(llama[0], TINY_LLAMA, CPU, tokens=256)


def _logits_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    batch = packed_batch([20, 30, 14], TINY_LLAMA.vocab, CPU, seed=0)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


class TestBenchFacts:
    def test_facts_of_the_built_model_are_read_from_its_config(self, llama):
        facts = bench_facts(llama[0], bench_config(TINY_LLAMA, tokens=256))
        assert (facts.model_type, facts.num_layers, facts.hidden_size, facts.head_dim) == ("llama", 2, 64, 16)
        assert facts.grouped_query and not facts.is_moe
        assert facts.fused_loss is None and facts.packed_attention is None
        assert facts.param_count == pytest.approx(TINY_LLAMA.param_count(), rel=0.01)

    def test_moe_facts_count_the_experts_blocks(self):
        model, _ = build_lora_model(TINY_GPT_OSS, CPU)
        facts = bench_facts(model, bench_config(TINY_GPT_OSS, tokens=256))
        assert (facts.model_type, facts.is_moe, facts.moe_blocks, facts.moe_routing) == ("gpt_oss", True, 2, None)
        assert facts.sliding_window and facts.attention_sinks

    @pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (CPU backend)")
    def test_qlora_model_facts_are_the_base_models(self):
        from bench.qlora import build_qlora_model
        from bench.workload import ModelShape

        tiny = ModelShape("tiny", "qwen3", 128, 2, 2, 1, 64, 256, 512)
        model, _ = build_qlora_model(tiny, CPU)
        facts = bench_facts(model, bench_config(tiny, method="qlora", tokens=256))
        assert (facts.model_type, facts.num_layers, facts.hidden_size) == ("qwen3", 2, 128)
        assert facts.fused_loss is None


class TestVariantPlan:
    def test_a_kernel_turned_off_is_replaced_and_nothing_else_changes(self, planner):
        default = planner.default
        chosen = planner.plan(off=("lora_kernel",))
        assert chosen.decision("lora_kernel") == KERNELS_OFF["lora_kernel"]
        assert chosen.decision("lora_kernel").backend == "peft"
        assert [d for d in chosen.decisions if d.name != "lora_kernel"] == [
            d for d in default.decisions if d.name != "lora_kernel"
        ]
        assert changes(chosen, default) == ["lora_kernel: off (peft): off in this variant"]

    def test_switches_go_through_the_plan(self, planner):
        chosen = planner.plan(packed_metadata_cache="off")
        cache = chosen.decision("packed_metadata_cache")
        assert (cache.requested, cache.enabled, cache.backend) == ("off", False, "sdpa")
        assert [c.split(":")[0] for c in planner.changes(chosen)] == ["packed_metadata_cache"]

    def test_offload_on_the_cpu_runs_the_offloaders_cpu_twin(self, planner):
        for reload, mode in (("on", "double"), ("off", "sync")):
            chosen = planner.plan(offload_activations="on", double_buffered_reload=reload)
            offload = chosen.decision("offload_activations")
            assert (offload.enabled, offload.backend, offload.reason) == (True, mode, CPU_OFFLOAD)
            assert chosen.decision("double_buffered_reload").enabled is (reload == "on")

    def test_an_unknown_kernel_to_turn_off_is_an_error(self, planner):
        with pytest.raises(KeyError):
            variant_plan(planner.hw, planner.config, planner.facts, off=("attention",))

    def test_the_default_is_the_trainers_plan_for_the_job(self, planner):
        assert planner.default == plan(detect("cpu"), planner.config, planner.facts)
        assert dataclasses.asdict(planner.config.optimizations) == {
            "packed_metadata_cache": "auto",
            "double_buffered_reload": "auto",
            "moe_grouped_routing": "auto",
            "offload_activations": "auto",
        }


class TestTrainStepVariants:
    def test_every_ftq_variant_name_is_a_recipe(self):
        assert [v for v in VARIANTS if v.startswith("ftq")] == list(RECIPES)

    @pytest.mark.parametrize("name", list(RECIPES))
    def test_variant_installs_its_plan_trains_and_is_removed_exactly(self, name, llama, planner):
        model, optimizer = llama
        before = _logits_and_grads(model)
        variant = Variant(name, model, TINY_LLAMA, CPU, planner)
        try:
            assert variant.installed[0].startswith("packed attention: sdpa, metadata built")
            loss, tokens = variant.micro_batches([20, 30, 14], seed=0)[0]()
            assert torch.isfinite(loss) and tokens == 64
            stock = Variant("stock packed", model, TINY_LLAMA, CPU)
            assert stock.installation is None
        finally:
            variant.close()
        after = _logits_and_grads(model)
        assert torch.equal(before[0], after[0])
        assert all(torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))

    def test_variants_differ_from_auto_in_their_own_decisions(self, llama, planner):
        names = {}
        for name in RECIPES:
            variant = Variant(name, llama[0], TINY_LLAMA, CPU, planner)
            variant.close()
            names[name] = sorted(line.split(":")[0] for line in variant.plan)
        # on the CPU auto already keeps plain checkpointing and transformers' own norm/MLP
        assert names == {
            "ftq": [],
            "ftq + offload": ["double_buffered_reload", "offload_activations"],
            "ftq, metadata cache off": ["packed_metadata_cache"],
            "ftq, peft LoRA": ["lora_kernel"],
            "ftq, unfused norm/SwiGLU": [],
        }

    def test_the_plans_loss_is_the_stock_loss(self, llama, planner):
        model, optimizer = llama
        lengths = packed_steps(1, tokens_per_step=128)[0]
        stock = Variant("stock packed", model, TINY_LLAMA, CPU)
        ftq = Variant("ftq", model, TINY_LLAMA, CPU, planner)
        try:
            with torch.no_grad():
                ftq_loss, _ = ftq.micro_batches(lengths, seed=3)[0]()
        finally:
            ftq.close()
        with torch.no_grad():
            stock_loss, _ = stock.micro_batches(lengths, seed=3)[0]()
        # bf16 weights: the fused chunked loss and HF's full-logits loss agree to bf16 rounding
        assert ftq_loss.item() == pytest.approx(stock_loss.item(), rel=2e-2)

    def test_cpu_timing_runs_the_steps(self, llama, planner):
        model, optimizer = llama
        variant = Variant("ftq + offload", model, TINY_LLAMA, CPU, planner)
        try:
            result = run_variant_cpu(variant, optimizer, packed_steps(2, tokens_per_step=128), 0, TINY_LLAMA)
        finally:
            variant.close()
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
        assert result.status == "ok" and result.tokens_per_s > 0 and len(result.losses) == 1


class TestOffloadBench:
    def test_each_variant_is_a_plan_and_the_gradients_match_checkpointing(self):
        from bench.offload import VARIANTS as OFFLOAD_VARIANTS
        from bench.offload import Result, Runner, gradients

        runner = Runner(TINY_LLAMA, CPU)
        with runner.installed("offload double") as installation:
            assert installation.describe() == [
                "packed attention: sdpa, metadata built once per batch",
                "activation policy: full, 2 of 2 layers checkpointed",
                "activation offload: 2 decoder layers, double-buffered reload",
                "loss: fused_chunked_ce",
            ]
        assert runner.installation is None
        results = {v: Result(TINY_LLAMA.name, v) for v in OFFLOAD_VARIANTS}
        gradients(runner, [20, 30, 14], results)
        assert all(r.grads_bitwise for r in results.values()), {v: r.grad_max_rel_diff for v, r in results.items()}
