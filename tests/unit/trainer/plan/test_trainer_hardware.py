"""Hardware detection and the plan: honest decisions, clear errors for impossible `on`."""

from __future__ import annotations

import json

import pytest
from plan_fakes import CPU, H100, plan_config
from trainer_helpers import run_cli

from trainer.config import Optimizations
from trainer.errors import PlanError
from trainer.plan.hardware import detect, peak_flops
from trainer.plan.types import ModelFacts
from trainer.plan.planner import plan


class TestDetect:
    def test_detects_this_cpu_machine_once(self):
        hw = detect("cpu")
        assert hw is detect("cpu")
        assert (
            hw.device == "cpu"
            and hw.peak_flops is None
            and "sdpa" in hw.attention_kernels
        )
        assert json.loads(json.dumps(hw.to_dict()))["cpu_count"] >= 1

    def test_varlen_options_read_from_the_source_are_the_imported_signature_s(self):
        """A CPU's facts read ``varlen_attn``'s keywords from torch's source (importing it pulls in
        torch._dynamo, ~1.5 s of every worker start's ``trainer detect``): the same tuple."""
        from trainer.plan.hardware import _varlen_options

        assert _varlen_options(imported=False) == _varlen_options()

    def test_detect_on_the_cpu_imports_neither_dynamo_nor_transformers(self):
        """``python -m trainer detect`` runs at every worker start: its imports are its cost."""
        import subprocess
        import sys

        code = ("import atexit, runpy, sys; sys.argv = ['trainer', 'detect', '--json', '--device', 'cpu']; "
                "atexit.register(lambda: print(sorted(m for m in ('torch._dynamo', 'transformers', 'peft') "
                "if m in sys.modules))); runpy.run_module('trainer', run_name='__main__')")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]

    def test_peak_flops_table_prefers_specific_names(self):
        assert peak_flops("NVIDIA H100 PCIe") == 756e12
        assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
        assert peak_flops("NVIDIA H200") == 989e12
        assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
        assert peak_flops("Some Future GPU") is None


class TestPlan:
    def test_cpu_auto_turns_off_what_needs_a_gpu_with_reasons(self):
        p = plan(CPU, plan_config(), ModelFacts("llama"))
        assert (p.device, p.dtype, p.attention_backend) == ("cpu", "float32", "sdpa")
        reasons = {d.name: (d.enabled, d.reason) for d in p.decisions}
        assert reasons["double_buffered_reload"] == (
            False,
            "offloading activations needs a CUDA GPU",
        )
        assert (
            reasons["moe_grouped_routing"][0] is False
            and "no MoE blocks" in reasons["moe_grouped_routing"][1]
        )
        assert reasons["packed_metadata_cache"][0] is True
        event = p.to_dict()
        assert set(event) == {"device", "dtype", "model_attention", "decisions"}
        assert {d["name"] for d in event["decisions"]} >= {"attention", "loss"}

    def test_on_that_cannot_run_names_the_hardware_and_the_fix(self):
        with pytest.raises(
            PlanError,
            match=r"double_buffered_reload=on cannot run: .*CUDA GPU.*x86_64 \(cpu, 2 cores\).*auto or off",
        ):
            plan(CPU, plan_config(double_buffered_reload="on"))

    def test_off_is_always_honoured(self):
        p = plan(H100, plan_config(packed_metadata_cache="off"))
        assert p.decision("packed_metadata_cache").reason.startswith("off in the job")

    def test_gpu_gets_bf16_and_eager_loading_for_models_without_sdpa(self):
        p = plan(
            H100,
            plan_config(),
            ModelFacts("gpt_oss", is_moe=True, supports_sdpa=False),
        )
        assert p.dtype == "bfloat16" and p.hf_attention == "eager"
        # installed over the eager model after loading
        assert p.decision("attention").enabled

    def test_switches_come_from_the_jobs_optimizations(self):
        p = plan(H100, plan_config(optimizations=Optimizations(packed_metadata_cache="off")))
        assert p.decision("packed_metadata_cache").requested == "off"
        assert p.decision("moe_grouped_routing").requested == "auto"

    def test_qlora_without_bitsandbytes_is_a_plan_error(self):
        with pytest.raises(
            PlanError, match="method=qlora needs a CUDA GPU with bitsandbytes"
        ):
            plan(H100, plan_config(method="qlora"))


@pytest.mark.slow  # two trainer CLI subprocesses (each imports torch): ~10-25 s on 2 cores
class TestDetectCli:
    def test_detect_prints_hardware_and_plan(self):
        result = run_cli("detect", "--json", "--device", "cpu")
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["hardware"]["device"] == "cpu"
        assert {d["name"] for d in out["plan"]["decisions"]} >= {
            "packed_metadata_cache",
            "double_buffered_reload",
            "moe_grouped_routing",
        }
        text = run_cli("detect", "--device", "cpu").stdout.splitlines()
        attention = next(line for line in text if line.startswith("attention "))
        assert attention.split()[:4] == ["attention", "auto", "->", "on"]
        assert "[sdpa]" in attention
        assert any(line.startswith("double_buffered_reload ") for line in text)
