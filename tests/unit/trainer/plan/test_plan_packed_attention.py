"""The plan's packed-attention, metadata-cache and loss decisions; the plan is pure, so fake CUDA
``Hardware`` objects exercise the GPU branches on a CPU box. Real runs and the CLI for the ends:
an impossible ``on`` fails the run as ``config_error``, and ``detect --json`` shows the decisions."""

from __future__ import annotations

import dataclasses
import json

import pytest
from plan_fakes import CPU, H100, plan_config
from trainer_helpers import make_job, run_cli

from trainer.config import SWITCHES, OptimConfig, Optimizations
from trainer.errors import PlanError
from trainer.events import make_event
from trainer.plan.types import Decision, ModelFacts, Plan
from trainer.plan.planner import capabilities, plan

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

LLAMA = ModelFacts("llama", head_dim=128, grouped_query=True)
GPT_OSS = ModelFacts(
    "gpt_oss",
    is_moe=True,
    supports_sdpa=False,
    head_dim=64,
    sliding_window=True,
    attention_sinks=True,
    grouped_query=True,
)
SOFTCAPPED = ModelFacts(
    "gemma2",
    head_dim=256,
    packed_attention="gemma2 soft-caps attention logits (attn_logit_softcapping=50.0)",
)
# torch >= 2.12 on an H200: varlen attention with every option.
H200_VARLEN = dataclasses.replace(
    H100,
    name="NVIDIA H200",
    attention_kernels=("sdpa", "flex_attention", "varlen"),
    varlen_options=("window_size", "return_aux", "enable_gqa"),
    triton_varlen=None,
    torch_version="2.12.0",
)
# torch 2.11 (no varlen) with our Triton kernel working.
H200_TRITON = dataclasses.replace(
    H200_VARLEN,
    attention_kernels=("sdpa", "flex_attention"),
    varlen_options=(),
    torch_version="2.11.0",
)


def _cache(p: Plan) -> Decision:
    return p.decision("packed_metadata_cache")


def _decisions(plan_event: dict) -> dict[str, dict]:
    """The plan event's decisions by name."""
    return {d["name"]: d for d in plan_event["decisions"]}


class TestCpu:
    def test_auto_caches_with_sdpa_and_fused_loss(self):
        p = plan(CPU, plan_config(), LLAMA)
        assert (p.attention_backend, p.loss_kernel) == ("sdpa", "fused_chunked_ce")
        assert p.decision("attention").enabled and p.hf_attention == "sdpa"
        d = _cache(p)
        assert (d.enabled, d.backend) == (True, "sdpa")
        assert d.reason.startswith("auto: ") and "once per batch" in d.reason
        assert "cpu: SDPA with the packed block-diagonal mask" in p.decision("attention").reason
        assert "never materialised" in p.decision("loss").reason

    def test_on_caches_and_says_so(self):
        d = _cache(
            plan(CPU, plan_config(packed_metadata_cache="on"), LLAMA)
        )
        assert d.enabled and d.reason.startswith("on in the job: ")

    def test_off_is_the_rebuild_per_layer_twin_on_the_same_backend(self):
        p = plan(CPU, plan_config(packed_metadata_cache="off"), LLAMA)
        d = _cache(p)
        assert (d.enabled, d.backend) == (False, "sdpa") and p.decision("attention").enabled
        assert (
            d.reason
            == "off in the job: metadata rebuilt in every layer from the device position ids"
        )

    def test_plain_loss_when_the_fused_loss_cannot_run_this_model(self):
        facts = dataclasses.replace(LLAMA, fused_loss="the LM head has a bias")
        p = plan(CPU, plan_config(), facts)
        assert p.loss_kernel == "torch_cross_entropy"
        assert p.decision("loss").reason == (
            "full logits in float32: the fused loss cannot run this model (the LM head has a bias)"
        )


class TestModelPackedAttentionCannotRun:
    def test_auto_falls_back_to_the_models_own_attention_and_says_why(self):
        p = plan(H200_VARLEN, plan_config(), SOFTCAPPED)
        assert p.attention_backend == "transformers_sdpa" and not p.decision("attention").enabled
        assert "soft-caps" in p.decision("attention").reason
        d = _cache(p)
        assert not d.enabled and "packed attention cannot run this model" in d.reason

    def test_eager_models_keep_eager(self):
        facts = dataclasses.replace(SOFTCAPPED, supports_sdpa=False)
        p = plan(CPU, plan_config(), facts)
        assert (p.attention_backend, p.hf_attention) == (
            "transformers_eager",
            "eager",
        )

    def test_on_is_a_plan_error_naming_the_hardware_and_the_fix(self):
        with pytest.raises(
            PlanError,
            match=r"packed_metadata_cache=on cannot run: packed attention cannot run this model "
            r"\(gemma2 soft-caps .*\) \(machine: NVIDIA H200 \(cuda, sm90\)\)\. Set packed_metadata_cache to auto or off",
        ):
            plan(
                H200_VARLEN,
                plan_config(packed_metadata_cache="on"),
                SOFTCAPPED,
            )

    def test_off_is_honoured(self):
        d = _cache(
            plan(CPU, plan_config(packed_metadata_cache="off"), SOFTCAPPED)
        )
        assert (d.enabled, d.reason) == (False, "off in the job")


class TestCudaBackendChoice:
    def test_torch_varlen_first_when_it_runs(self):
        for facts in (LLAMA, GPT_OSS):
            p = plan(H200_VARLEN, plan_config(), facts)
            assert (
                p.attention_backend == "torch_varlen"
                and _cache(p).backend == "torch_varlen"
            )
            assert p.dtype == "bfloat16"

    def test_our_triton_kernel_when_torch_has_no_varlen(self):
        p = plan(H200_TRITON, plan_config(), LLAMA)
        assert p.attention_backend == "triton"
        assert (
            "not torch_varlen: torch 2.11.0 has no torch.nn.attention.varlen"
            in p.decision("attention").reason
        )

    def test_varlen_without_window_or_lse_yields_to_triton_for_gpt_oss(self):
        no_window = dataclasses.replace(
            H200_VARLEN, varlen_options=("return_aux", "enable_gqa")
        )
        p = plan(no_window, plan_config(), GPT_OSS)
        assert (
            p.attention_backend == "triton"
            and "uses a sliding window" in p.decision("attention").reason
        )
        no_lse = dataclasses.replace(
            H200_VARLEN, varlen_options=("window_size", "enable_gqa")
        )
        p = plan(no_lse, plan_config(), GPT_OSS)
        assert (
            p.attention_backend == "triton" and "attention sinks" in p.decision("attention").reason
        )
        # Llama needs neither option.
        assert (
            plan(no_lse, plan_config(), LLAMA).attention_backend
            == "torch_varlen"
        )

    def test_varlen_without_enable_gqa_yields_to_triton_for_gqa_models(self):
        """Seen on the lent H200's torch: varlen_attn there takes no enable_gqa."""
        old = dataclasses.replace(
            H200_VARLEN, varlen_options=("window_size", "return_aux")
        )
        p = plan(old, plan_config(), LLAMA)
        assert (
            p.attention_backend == "triton"
            and "has no enable_gqa" in p.decision("attention").reason
        )
        mha = dataclasses.replace(LLAMA, grouped_query=False)
        assert (
            plan(old, plan_config(), mha).attention_backend
            == "torch_varlen"
        )

    def test_sdpa_block_mask_last_with_both_reasons(self):
        odd_head = dataclasses.replace(LLAMA, head_dim=96)
        p = plan(H200_TRITON, plan_config(), odd_head)
        assert p.attention_backend == "sdpa"
        assert "not torch_varlen: " in p.decision("attention").reason
        assert "not triton: head dim 96 is not one of 64, 128" in p.decision("attention").reason
        no_triton = dataclasses.replace(
            H200_TRITON, triton_varlen="Triton is not installed (pip install triton)"
        )
        p = plan(no_triton, plan_config(packed_metadata_cache="on"), LLAMA)
        assert (
            p.attention_backend == "sdpa"
            and "Triton is not installed" in p.decision("attention").reason
        )
        assert _cache(
            p
        ).enabled  # the cache helps every backend: on is honoured with SDPA too


class TestCapabilities:
    def test_cpu_worker(self):
        caps = capabilities(CPU, plan_config())
        assert set(caps) == set(SWITCHES)
        assert caps["packed_metadata_cache"] is None
        assert (
            caps["double_buffered_reload"] == "offloading activations needs a CUDA GPU"
        )
        assert caps["offload_activations"] == "offloading activations needs a CUDA GPU"
        # grouped routing runs on a CPU too (the per-expert-slice loop): a forced on is accepted
        # by the API, and the trainer's plan refuses it only for a model without MoE blocks
        assert caps["moe_grouped_routing"] is None

    def test_gpu_worker_can_honour_every_switch(self):
        caps = capabilities(H200_TRITON, plan_config())
        assert caps == dict.fromkeys(SWITCHES)

    def test_plan_and_capabilities_are_json(self):
        p = plan(H200_VARLEN, plan_config(), GPT_OSS)
        out = json.loads(
            json.dumps(
                {"plan": p.to_dict(), "capabilities": capabilities(CPU, plan_config())}
            )
        )
        decisions = _decisions(out["plan"])
        assert decisions["attention"]["backend"] == "torch_varlen"
        assert decisions["loss"]["backend"] == "fused_chunked_ce"


def _gemma2_own_attention() -> str:
    """The attention transformers itself declares for Gemma 2: eager from 5.24 on (its SDPA path
    drops the soft-capping), SDPA before (5.17, the GPU image's). The trainer follows the class."""
    from transformers import Gemma2PreTrainedModel

    return "transformers_sdpa" if Gemma2PreTrainedModel._supports_sdpa else "transformers_eager"


def _tiny_gemma2(directory):
    """A tiny Gemma 2 (attention logit soft-capping: packed attention cannot run it, so it falls
    back to the model's own attention, ``_gemma2_own_attention()``, with the packed block masks)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from trainer.model.tiny import build_tokenizer

    tok = build_tokenizer()
    config = Gemma2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.slow  # real runs and trainer CLI subprocesses: 6-40 s each on 2 cores
class TestRuns:
    def test_impossible_on_ends_failed_config_error_naming_the_fix(self, tmp_path):
        model_dir = _tiny_gemma2(tmp_path / "gemma2")
        events: list[dict] = []
        config = make_job(
            tmp_path,
            model_dir,
            optimizations=Optimizations(packed_metadata_cache="on"),
        )
        from trainer.training.train import run

        result = run(config, lambda t, **p: events.append(make_event(t, **p)))
        done = events[-1]
        assert done["type"] == "done" and (done["status"], done["error_code"]) == (
            "failed",
            "config_error",
        )
        assert "packed_metadata_cache=on cannot run" in done["message"]
        assert "Set packed_metadata_cache to auto or off" in done["message"]
        assert "soft-caps attention logits" in done["message"]
        assert result.steps == 0 and not [e for e in events if e["type"] == "step"]

    def test_auto_trains_such_a_model_through_its_own_attention(
        self, tmp_path, one_thread
    ):
        model_dir = _tiny_gemma2(tmp_path / "gemma2")
        events: list[dict] = []
        config = make_job(tmp_path, model_dir, optim=OptimConfig(max_steps=2))
        from trainer.training.train import run

        result = run(config, lambda t, **p: events.append(make_event(t, **p)))
        assert result.status == "succeeded", result.message
        plan_event = next(e for e in events if e["type"] == "plan")
        decisions = _decisions(plan_event)
        attention = decisions["attention"]
        assert (attention["enabled"], attention["backend"]) == (False, _gemma2_own_attention())
        # Gemma 2's final-logit soft-capping is one the fused loss applies per chunk.
        assert decisions["loss"]["backend"] == "fused_chunked_ce"

    def test_detect_json_shows_decisions_and_capabilities(self, tmp_path):
        out = run_cli("detect", "--json", "--device", "cpu")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        decisions = _decisions(report["plan"])
        assert decisions["packed_metadata_cache"]["enabled"] is True
        assert decisions["attention"]["backend"] == "sdpa"
        assert decisions["loss"]["backend"] == "fused_chunked_ce"
        assert report["capabilities"]["packed_metadata_cache"] is None
        assert "CUDA GPU" in report["capabilities"]["double_buffered_reload"]

    def test_detect_for_a_job_plans_with_the_models_facts(self, tmp_path):
        model_dir = _tiny_gemma2(tmp_path / "gemma2")
        make_job(tmp_path, model_dir).save(tmp_path / "job.json")
        out = run_cli("detect", "--json", "--job", str(tmp_path / "job.json"))
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert _decisions(report["plan"])["attention"]["backend"] == _gemma2_own_attention()
        text = run_cli("detect", "--job", str(tmp_path / "job.json"))
        attention = next(line for line in text.stdout.splitlines() if line.startswith("attention "))
        assert attention.split()[:5] == ["attention", "auto", "->", "off", f"[{_gemma2_own_attention()}]"]
        assert "packed attention cannot run gemma2" in attention
        assert any(
            line.split() == ["can", "be", "on", "packed_metadata_cache"]
            for line in text.stdout.splitlines()
        )
