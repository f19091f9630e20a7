"""The plan's offload and MoE decisions: offloaded activations, the double-buffered reload, MoE
grouped routing. The plan is pure, so fake CUDA ``Hardware`` objects exercise the GPU branches on a
CPU box; ``model_facts`` and ``apply_lora`` run on the tiny MoE models for the facts they feed it."""

from __future__ import annotations

import dataclasses

import pytest
from plan_fakes import CPU, H100, plan_config

from trainer.config import SWITCHES, DataConfig, LoraConfig
from trainer.errors import ConfigError, PlanError
from trainer.plan.types import Decision, ModelFacts, Plan
from trainer.plan.planner import capabilities, plan

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

LLAMA_8B = ModelFacts(
    "llama", head_dim=128, num_layers=32, hidden_size=4096, param_count=8_030_000_000
)
GPT_OSS_20B = ModelFacts(
    "gpt_oss",
    is_moe=True,
    head_dim=64,
    num_layers=24,
    hidden_size=2880,
    param_count=20_900_000_000,
    moe_blocks=24,
    moe_family="gpt_oss",
)
BIG_HOST_H100 = dataclasses.replace(H100, host_memory=512 * 2**30)
SMALL_GPU = dataclasses.replace(
    BIG_HOST_H100, name="NVIDIA A10G", gpu_memory=20 * 2**30, capability=(8, 6)
)


def _tokens(n: int, **kw: object):
    """A job of ``n``-token batches; ``kw`` as for ``plan_config`` (switches included)."""
    return dataclasses.replace(
        plan_config(**kw), data=DataConfig("t", max_seq_len=n, batch_tokens=n)
    )


def _pair(p: Plan) -> tuple[Decision, Decision]:
    return p.decision("offload_activations"), p.decision("double_buffered_reload")


class TestOffloadDecisions:
    def test_auto_keeps_plain_checkpointing_when_the_inputs_fit(self):
        offload, double = _pair(
            plan(BIG_HOST_H100, _tokens(16_384), LLAMA_8B)
        )
        assert not offload.enabled and not double.enabled
        # 32 layers x 16,384 tokens x 4096 x 2 bytes = 4 GiB, against half of (80 GiB - 16 GB of weights)
        assert (
            "layer inputs 4.00 GiB at 16384 tokens fit in 32.52 GiB" in offload.reason
        )
        assert "nothing to reload" in double.reason

    def test_auto_offloads_and_double_buffers_when_they_do_not_fit(self):
        offload, double = _pair(
            plan(BIG_HOST_H100, _tokens(262_144), LLAMA_8B)
        )
        # the offload decision carries the reload mode (what trainer.features.offload.feature.apply reads)
        assert offload.enabled and offload.backend == "double"
        assert (
            "layer inputs 64.00 GiB at 262144 tokens would not fit in 32.52 GiB"
            in offload.reason
        )
        assert "62.00 GiB to pinned host memory" in offload.reason
        assert double.enabled and double.backend == "double"
        assert "extra GPU memory for the second buffer: 2.000 GiB" in double.reason

    def test_on_offloads_even_when_the_inputs_fit(self):
        offload, double = _pair(
            plan(
                BIG_HOST_H100,
                _tokens(16_384, offload_activations="on"),
                LLAMA_8B,
            )
        )
        assert offload.enabled and offload.reason.startswith("on in the job")
        assert (
            double.enabled and "0.125 GiB" in double.reason
        )  # the seed's 8B figure is 0.37 GB at 48k

    def test_double_buffer_off_reloads_synchronously(self):
        offload, double = _pair(
            plan(BIG_HOST_H100, _tokens(262_144, double_buffered_reload="off"), LLAMA_8B)
        )
        assert (offload.enabled, offload.backend) == (True, "sync")
        assert (double.enabled, double.backend, double.requested) == (False, "sync", "off")
        assert double.reason.startswith("off in the job")

    def test_no_room_for_the_second_buffer_reloads_synchronously_or_refuses_on(self):
        # 20 GiB GPU, 9.5e9 bf16 params (17.7 GiB): 2.3 GiB left, 1 GiB per buffer at 131,072 tokens
        facts = dataclasses.replace(LLAMA_8B, param_count=9_500_000_000)
        offload, double = _pair(
            plan(SMALL_GPU, _tokens(131_072), facts)
        )
        assert offload.enabled
        assert (double.enabled, double.backend) == (False, "sync")
        assert (
            "second reload buffer needs 1.00 GiB plus 512 MiB headroom" in double.reason
        )
        with pytest.raises(
            PlanError,
            match=r"double_buffered_reload=on cannot run: the second reload buffer.*A10G",
        ):
            plan(
                SMALL_GPU,
                _tokens(131_072, double_buffered_reload="on"),
                facts,
            )

    def test_host_memory_says_no(self):
        small_host = dataclasses.replace(H100, host_memory=32 * 2**30)
        offload, double = _pair(
            plan(small_host, _tokens(262_144), LLAMA_8B)
        )
        assert (
            not offload.enabled and "62.0 GiB of pinned host memory" in offload.reason
        )
        assert not double.enabled
        with pytest.raises(
            PlanError,
            match=r"offload_activations=on cannot run: .*pinned host memory.*data.batch_tokens",
        ):
            plan(
                small_host,
                _tokens(262_144, offload_activations="on"),
                LLAMA_8B,
            )

    def test_double_buffer_on_without_offload_says_how_to_get_it(self):
        with pytest.raises(
            PlanError,
            match=r"double_buffered_reload=on needs offloaded activations.*offload_activations to on",
        ):
            plan(
                BIG_HOST_H100,
                _tokens(16_384, double_buffered_reload="on"),
                LLAMA_8B,
            )

    def test_unknown_shape_keeps_auto_off_and_honours_on(self):
        unknown = ModelFacts("custom")
        offload, _ = _pair(
            plan(BIG_HOST_H100, _tokens(16_384), unknown)
        )
        assert not offload.enabled and "unknown" in offload.reason
        offload, double = _pair(
            plan(
                BIG_HOST_H100,
                _tokens(16_384, offload_activations="on"),
                unknown,
            )
        )
        assert offload.enabled and double.enabled

    def test_cpu_and_no_checkpointing_refuse_on(self):
        offload, _ = _pair(plan(CPU, _tokens(16_384), LLAMA_8B))
        assert (offload.enabled, offload.reason) == (
            False,
            "offloading activations needs a CUDA GPU",
        )
        with pytest.raises(
            PlanError,
            match="offload_activations=on cannot run: offloading activations needs a CUDA GPU",
        ):
            plan(
                CPU,
                _tokens(16_384, offload_activations="on"),
                LLAMA_8B,
            )
        with pytest.raises(PlanError, match="gradient_checkpointing is off"):
            plan(
                BIG_HOST_H100,
                _tokens(16_384, offload_activations="on", gradient_checkpointing=False),
                LLAMA_8B,
            )


class TestMoeDecision:
    def test_gpu_auto_groups_every_block_with_grouped_mm_and_triton(self):
        d = plan(H100, plan_config(), GPT_OSS_20B).decision(
            "moe_grouped_routing"
        )
        assert (d.enabled, d.backend) == (True, "grouped_mm")
        assert (
            d.reason
            == "auto: grouped routing on 24 MoE blocks (gpt_oss), grouped_mm, Triton combine + gate"
        )

    def test_cpu_uses_the_slice_loop_and_no_triton(self):
        d = plan(
            CPU, plan_config(moe_grouped_routing="on"), GPT_OSS_20B
        ).decision("moe_grouped_routing")
        assert (d.enabled, d.backend) == (True, "loop")
        assert d.reason.startswith(
            "on in the job: grouped routing on 24 MoE blocks (gpt_oss), per-expert slices"
        )
        assert "Triton" not in d.reason

    def test_fp32_on_a_gpu_cannot_use_grouped_mm(self):
        cfg = dataclasses.replace(
            plan_config(), model=dataclasses.replace(plan_config().model, dtype="float32")
        )
        d = plan(H100, cfg, GPT_OSS_20B).decision(
            "moe_grouped_routing"
        )
        assert d.backend == "loop" and "Triton combine + gate" in d.reason

    def test_off_is_the_eager_loop(self):
        d = plan(
            H100, plan_config(moe_grouped_routing="off"), GPT_OSS_20B
        ).decision("moe_grouped_routing")
        assert (d.enabled, d.backend) == (False, "eager")
        assert "eager per-expert loop on 24 MoE blocks" in d.reason

    def test_dense_model(self):
        d = plan(H100, plan_config(), LLAMA_8B).decision(
            "moe_grouped_routing"
        )
        assert not d.enabled and d.reason == "no MoE blocks in this model (llama)"
        with pytest.raises(
            PlanError,
            match=r"moe_grouped_routing=on cannot run: no MoE blocks in this model \(llama\)",
        ):
            plan(H100, plan_config(moe_grouped_routing="on"), LLAMA_8B)

    def test_unsupported_experts_refuse_on(self):
        quantized = dataclasses.replace(
            GPT_OSS_20B, moe_routing="gpt_oss has quantized experts"
        )
        assert (
            not plan(H100, plan_config(), quantized)
            .decision("moe_grouped_routing")
            .enabled
        )
        with pytest.raises(PlanError, match="quantized experts"):
            plan(H100, plan_config(moe_grouped_routing="on"), quantized)


class TestCapabilities:
    def test_gpu_worker_can_honour_every_on(self):
        """What the API's forced-switch check reads: None = a worker here can run ``on``. MoE
        routing is judged for a model that has MoE blocks (the API cannot see the model)."""
        assert capabilities(H100, plan_config()) == dict.fromkeys(SWITCHES)

    def test_cpu_worker_can_route_moe_but_not_offload(self):
        caps = capabilities(CPU, plan_config())
        assert caps["moe_grouped_routing"] is None
        assert (
            caps["offload_activations"]
            == caps["double_buffered_reload"]
            == ("offloading activations needs a CUDA GPU")
        )


class TestModelFacts:
    @pytest.mark.parametrize(
        ("arch", "family"),
        [("gpt_oss", "gpt_oss"), ("qwen3_moe", "qwen3_moe"), ("llama", None)],
    )
    def test_facts_for_the_plan(self, tiny_models, arch, family):
        from trainer.model.load import model_facts

        config = plan_config()
        model = dataclasses.replace(config.model, name_or_path=str(tiny_models[arch]))
        facts = model_facts(dataclasses.replace(config, model=model))
        assert (facts.num_layers, facts.hidden_size) == (2, 64)
        assert facts.param_count and facts.param_count > 10_000
        assert (facts.moe_blocks, facts.moe_family, facts.moe_routing) == (
            (2, family, None) if family else (0, None, None)
        )


class TestExpertLora:
    @pytest.mark.parametrize("arch", ["gpt_oss", "qwen3_moe"])
    def test_all_linear_adapts_the_expert_weights(self, tiny_models, arch):
        from transformers import AutoModelForCausalLM

        from trainer.model.load import apply_lora

        model = apply_lora(
            AutoModelForCausalLM.from_pretrained(tiny_models[arch]), LoraConfig(r=4, alpha=8)
        )
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert any("experts" in n and "lora_A" in n for n in trainable), trainable
        assert any("q_proj.lora_A" in n for n in trainable)

    def test_dropout_with_expert_lora_is_refused_with_the_fix(self, tiny_models):
        from transformers import AutoModelForCausalLM

        from trainer.model.load import apply_lora

        with pytest.raises(
            ConfigError,
            match=r"lora.dropout=0.1 .*MoE.*Set lora.dropout to 0, or list lora.target_modules",
        ):
            apply_lora(
                AutoModelForCausalLM.from_pretrained(tiny_models["gpt_oss"]),
                LoraConfig(dropout=0.1),
            )
        # explicit targets keep dropout and leave the experts frozen
        model = apply_lora(
            AutoModelForCausalLM.from_pretrained(tiny_models["gpt_oss"]),
            LoraConfig(dropout=0.1, target_modules=("q_proj", "v_proj")),
        )
        assert not any(
            "experts" in n for n, p in model.named_parameters() if p.requires_grad
        )
