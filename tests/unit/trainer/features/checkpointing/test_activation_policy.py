"""The activation policy: the memory estimate's arithmetic (hand-checked), the plan's choice of
policy from it (fake GPUs: the plan is pure), the job field, and the layers each policy checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
from plan_fakes import CPU, H100, plan_config

from trainer.plan import memory
from trainer.config import DataConfig, TrainConfig
from trainer.errors import PlanError
from trainer.features.checkpointing import policy as checkpointing
from trainer.plan.memory import GIB, Shape, Workload, estimate
from trainer.plan.types import ModelFacts
from trainer.plan.planner import plan

TOY = Shape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32)
TOY_WORK = Workload(tokens=10, max_seq_len=10, lora_rank=2)
LLAMA_8B = Shape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14_336, vocab=128_256)
LLAMA_8B_FACTS = ModelFacts(
    "llama", head_dim=128, num_layers=32, hidden_size=4096, param_count=8_030_261_248,
    shape=dataclasses.replace(LLAMA_8B, param_count=8_030_261_248),
)
H200 = dataclasses.replace(H100, name="NVIDIA H200", gpu_memory=140 * GIB, host_memory=2048 * GIB)


def _job(**kw: object) -> TrainConfig:
    """The bench workload's job: 16,384-token batches, LoRA r=16."""
    return dataclasses.replace(plan_config(**kw), data=DataConfig("t", max_seq_len=4096, batch_tokens=16_384))


class TestEstimateArithmetic:
    """A toy shape checked by hand: H 8, Hq 2 x D 4, Hkv 1 x 4, I 16, V 32, 2 layers, bf16, 10 tokens."""

    def test_sizes(self) -> None:
        assert TOY.attention_params == 8 * 4 * (2 * 2 + 2 * 1) == 192
        assert TOY.base_params() == 2 * (192 + 3 * 8 * 16) + 2 * 32 * 8 == 1664
        # per layer, r (in + out) summed: q 16, k 12, v 12, o 16, gate 24, up 24, down 24 = 128
        assert TOY.lora_params(rank=2) == 2 * 2 * 128 == 512
        # 4H + 2 Hq D + 2 Hkv D + 3I = 32 + 16 + 8 + 48
        assert TOY.activation_elements_per_token() == 104

    def test_each_policy(self) -> None:
        whole, layer_input = 10 * 2 * 104, 10 * 2 * 8  # 2,080 and 160 bytes
        weights, lora = 2 * 1664, 16 * 512
        workspace = 12 * 10 * 32 + 2 * 10 * 8  # one loss chunk (10 tokens x V, 12 B) + hidden grad
        expected = {
            "none": 2 * whole,
            "selective": whole + layer_input,  # layer 0 checkpointed, layer 1 keeps everything
            "full": 2 * layer_input + whole,
            "full+offload": 3 * layer_input + whole,  # last input + 2 reload buffers + a recompute
        }
        for policy, activations in expected.items():
            est = estimate(TOY, TOY_WORK, policy, 1 if policy == "selective" else None)
            assert (est.weights, est.trainable, est.activations, est.workspace) == (
                weights, lora, activations, workspace
            ), policy
            assert est.peak == weights + lora + activations + workspace

    def test_moe_keeps_k_experts_per_token_and_the_merged_expert_weight(self) -> None:
        """4 experts of Ie 6, top-2: per token 4H + 2 Hq D + 2 Hkv D + k (H + 3 Ie) = 56 + 52
        elements, 4 E bytes of fp32 router; per layer the merged W + B A of 3 x 4 x 8 x 6 weights."""
        moe = dataclasses.replace(TOY, experts=4, experts_per_token=2, expert_intermediate=6)
        assert moe.activation_elements_per_token() == 108
        whole = 10 * 2 * 108 + 4 * 4 * 10 + 2 * 3 * 4 * 8 * 6  # 2,160 + 160 + 1,152
        est = estimate(moe, TOY_WORK, "none")
        assert est.activations == 2 * whole
        # backward: 2 b T k Ie = 480, + the merged weight's gradient 1,152; the loss chunk (3,840) is larger
        assert est.workspace == 12 * 10 * 32 + 2 * 10 * 8
        full_ft = estimate(moe, dataclasses.replace(TOY_WORK, method="full"), "none")
        assert full_ft.activations == 2 * (whole - 1152)  # trained experts: no LoRA merge

    def test_qlora_weights_are_nf4_for_the_decoder_linears_only(self) -> None:
        est = estimate(TOY, dataclasses.replace(TOY_WORK, method="qlora"), "full")
        linear = 2 * 576
        assert est.weights == round(linear * 0.515869140625 + (1664 - linear) * 2)

    def test_full_fine_tuning_sharded_over_four_ranks(self) -> None:
        work = dataclasses.replace(TOY_WORK, method="full", world_size=4, sharded=True)
        est = estimate(TOY, work, "full")
        assert est.weights == 4 * 1664 // 4 + 2 * 2 * 576  # fp32 master shard + two gathered layers
        assert est.trainable == 12 * 1664 // 4

    def test_llama_8b_matches_the_h200_measurements(self) -> None:
        """139.3 KB per token per layer (138.4 KB measured); peaks at 16,384 tokens of 90.1 GB
        without checkpointing and 24.1 GB (22.49 GiB) with it, measured on an H200."""
        assert 2 * LLAMA_8B.activation_elements_per_token() == 139_264
        work = Workload(tokens=16_384, max_seq_len=4096)
        shape = LLAMA_8B_FACTS.shape
        assert estimate(shape, work, "none").peak / 90.1e9 == pytest.approx(1, abs=0.02)
        assert estimate(shape, work, "full").peak / 24.1e9 == pytest.approx(1, abs=0.02)

    def test_the_issue_4_ablation_peaks_on_an_h200(self) -> None:
        """docs/benchmarks.md (issue 4, ``max_memory_allocated``, H200): Qwen3-0.6B with full
        checkpointing 3.34 GiB, Qwen3-14B QLoRA offloaded 14.80 GiB, GPT-OSS-20B offloaded
        46.76 GiB; the estimate within 10%."""
        from bench.qlora import QWEN3_14B
        from bench.workload import GPT_OSS_20B, QWEN3_0_6B

        work = Workload(tokens=16_384, max_seq_len=4096)
        for bench_shape, method, policy, measured in (
            (QWEN3_0_6B, "lora", "full", 3.34), (QWEN3_14B, "qlora", "full+offload", 14.80),
            (GPT_OSS_20B, "lora", "full+offload", 46.76),
        ):
            shape = Shape(
                bench_shape.layers, bench_shape.hidden, bench_shape.heads, bench_shape.kv_heads,
                bench_shape.head_dim, bench_shape.intermediate, bench_shape.vocab, experts=bench_shape.experts,
                experts_per_token=bench_shape.experts_per_token,
                expert_intermediate=bench_shape.intermediate if bench_shape.experts else 0,
                qk_norm=bench_shape.family == "qwen3", param_count=bench_shape.param_count(),
            )
            est = estimate(shape, dataclasses.replace(work, method=method), policy).peak / GIB
            assert est / measured == pytest.approx(1, abs=0.1), (bench_shape.name, est)

    def test_budget_names_the_margin_and_the_cap(self) -> None:
        free = int(139.7 * GIB)
        assert memory.Budget(free).describe() == "139.7 GiB free - 6.2 GiB margin"
        capped = memory.Budget(free, 40 * GIB)
        assert capped.describe() == "40.0 GiB (max_gpu_memory_gb; 139.7 GiB free) - 3.2 GiB margin"
        assert capped.usable == 40 * GIB - memory.margin(40 * GIB)


class TestPolicyChoice:
    def _policy(self, hw=H200, free: float | None = None, **kw: object):
        free_bytes = None if free is None else int(free * GIB)
        p = plan(hw, _job(**kw), LLAMA_8B_FACTS, free_gpu_bytes=free_bytes)
        return p.decision("gradient_checkpointing"), p.decision("offload_activations")

    def test_keeps_everything_on_an_h200(self) -> None:
        policy, offload = self._policy(free=139.7)
        assert (policy.enabled, policy.backend) == (False, "none")
        assert policy.reason.startswith("keep all: est. 84.6 GiB (weights 15.0,")
        assert policy.reason.endswith("of 139.7 GiB free - 6.2 GiB margin")
        assert not offload.enabled and "is none" in offload.reason

    def test_checkpoints_as_few_layers_as_fit_on_an_h100(self) -> None:
        policy, _ = self._policy(H100, free=79.2)
        assert policy.backend.startswith("selective:") and policy.backend.endswith("/32")
        n = checkpointing.checkpointed_count(policy.backend, 32)
        usable = memory.Budget(int(79.2 * GIB)).usable
        work = Workload(tokens=16_384, max_seq_len=4096)
        assert estimate(LLAMA_8B_FACTS.shape, work, "selective", n).peak <= usable
        assert estimate(LLAMA_8B_FACTS.shape, work, "selective", n - 1).peak > usable
        assert f"checkpoint {n} of 32 layers" in policy.reason

    def test_the_job_cap_binds_down_to_offload(self) -> None:
        """Checkpointing L-1 layers needs less than full checkpointing (the last layer's inputs
        are not kept beside its recompute), so ``auto`` goes from selective to offload."""
        policy, offload = self._policy(free=139.7, max_gpu_memory_gb=30)
        assert policy.backend == "selective:29/32" and "30.0 GiB (max_gpu_memory_gb; 139.7 GiB free)" in policy.reason
        assert not offload.enabled
        policy, offload = self._policy(free=139.7, max_gpu_memory_gb=24)
        assert policy.backend == "full+offload" and "full checkpointing alone: est. 22.7 GiB" in policy.reason
        assert offload.enabled and offload.backend == "double"

    def test_full_when_offload_is_off_says_it_does_not_fit(self) -> None:
        policy, offload = self._policy(free=139.7, max_gpu_memory_gb=24, offload_activations="off")
        assert policy.backend == "full" and "does not fit; no offload: offload_activations is off" in policy.reason
        assert not offload.enabled

    def test_on_off_and_selective_in_the_job(self) -> None:
        assert self._policy(free=139.7, gradient_checkpointing="on")[0].backend == "full"
        off, _ = self._policy(free=10, gradient_checkpointing="off")
        assert (off.enabled, off.backend, off.requested) == (False, "none", "off")
        selective, _ = self._policy(free=139.7, gradient_checkpointing="selective")
        assert selective.backend == "selective:1/32" and selective.requested == "selective"

    def test_offload_on_means_full_plus_offload_and_refuses_selective(self) -> None:
        policy, offload = self._policy(free=139.7, offload_activations="on")
        assert policy.backend == "full+offload" and offload.enabled
        with pytest.raises(PlanError, match="gradient_checkpointing=selective with offload_activations=on"):
            self._policy(free=139.7, offload_activations="on", gradient_checkpointing="selective")

    def test_cpu_checkpoints_every_layer_without_an_estimate(self) -> None:
        policy, _ = self._policy(CPU)
        assert policy.backend == "full" and "no GPU memory to plan for" in policy.reason


class TestCheckpointedLayers:
    def test_the_first_n_layers(self) -> None:
        assert checkpointing.checkpointed_layers(2, 4) == {0, 1}
        assert checkpointing.checkpointed_layers(0, 4) == set()
        assert checkpointing.checkpointed_count("selective:3/8", 8) == 3
        assert checkpointing.checkpointed_count("full+offload", 8) == 8
        assert checkpointing.checkpointed_count("none", 8) == 0


class TestJobField:
    def test_old_booleans_read_as_on_and_off(self) -> None:
        raw = _job().to_dict()
        assert raw["gradient_checkpointing"] == "auto" and raw["max_gpu_memory_gb"] is None
        assert TrainConfig.from_dict({**raw, "gradient_checkpointing": True}).gradient_checkpointing == "on"
        assert TrainConfig.from_dict({**raw, "gradient_checkpointing": False}).gradient_checkpointing == "off"

    def test_bad_values_name_the_field(self) -> None:
        raw = _job().to_dict()
        with pytest.raises(ValueError, match=r"gradient_checkpointing: 'some' is not one of auto, on, off, selective"):
            TrainConfig.from_dict({**raw, "gradient_checkpointing": "some"})
        for bad in (0, -1.5, "40", True):
            with pytest.raises(ValueError, match="max_gpu_memory_gb: must be a number of GiB > 0"):
                TrainConfig.from_dict({**raw, "max_gpu_memory_gb": bad})
        assert TrainConfig.from_dict({**raw, "max_gpu_memory_gb": 40}).max_gpu_memory_gb == 40
