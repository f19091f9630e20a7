"""Hardware detection and the plan: honest decisions, clear errors for impossible `on`."""

from __future__ import annotations

import dataclasses
import json

import pytest
from trainer_helpers import run_cli

from trainer import hardware
from trainer.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    Optimizations,
    TrainConfig,
)
from trainer.errors import PlanError
from trainer.hardware import Hardware, ModelFacts, detect, peak_flops, plan

CPU = Hardware(
    device="cpu",
    name="x86_64",
    capability=None,
    gpu_count=0,
    gpu_memory=None,
    host_memory=2**34,
    pinned_memory=False,
    bf16=False,
    triton=False,
    attention_kernels=("sdpa",),
    bitsandbytes=False,
    cpu_count=2,
    torch_version="2.13",
    cuda_version=None,
    peak_flops=None,
)
H100 = dataclasses.replace(
    CPU,
    device="cuda",
    name="NVIDIA H100 80GB HBM3",
    capability=(9, 0),
    gpu_count=1,
    gpu_memory=80 * 2**30,
    pinned_memory=True,
    bf16=True,
    triton=True,
    cuda_version="12.8",
    peak_flops=989e12,
)


def _config(**kw: object) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("m"),
        data=DataConfig("t"),
        optim=OptimConfig(max_steps=1),
        output_dir="o",
        **kw,
    )


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

    def test_peak_flops_table_prefers_specific_names(self):
        assert peak_flops("NVIDIA H100 PCIe") == 756e12
        assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
        assert peak_flops("NVIDIA H200") == 989e12
        assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
        assert peak_flops("Some Future GPU") is None


class TestPlan:
    def test_cpu_auto_turns_off_what_needs_a_gpu_with_reasons(self):
        p = plan(CPU, Optimizations(), _config(), ModelFacts("llama"))
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
        assert set(p.to_dict()) >= {"decisions", "attention_backend", "loss_kernel"}

    def test_on_that_cannot_run_names_the_hardware_and_the_fix(self):
        with pytest.raises(
            PlanError,
            match=r"double_buffered_reload=on cannot run: .*CUDA GPU.*x86_64 \(cpu, 2 cores\).*auto or off",
        ):
            plan(CPU, Optimizations(double_buffered_reload="on"), _config())

    def test_off_is_always_honoured(self):
        p = plan(H100, Optimizations(packed_metadata_cache="off"), _config())
        assert p.decision("packed_metadata_cache").reason.startswith("off in the job")

    def test_gpu_gets_bf16_and_eager_loading_for_models_without_sdpa(self):
        p = plan(
            H100,
            Optimizations(),
            _config(),
            ModelFacts("gpt_oss", is_moe=True, supports_sdpa=False),
        )
        assert p.dtype == "bfloat16" and p.load_attn_implementation == "eager"
        assert p.packed_attention  # installed over the eager model after loading

    def test_unbuilt_optimizations_stay_off_on_auto_and_refuse_on(self, monkeypatch):
        monkeypatch.setattr(hardware, "BUILT_OPTIMIZATIONS", frozenset())
        p = plan(H100, Optimizations(), _config())
        assert p.decision("packed_metadata_cache").reason == (
            "it is not implemented in this build of the trainer"
        )
        with pytest.raises(PlanError, match="not implemented in this build"):
            plan(H100, Optimizations(packed_metadata_cache="on"), _config())

    def test_qlora_without_bitsandbytes_is_a_plan_error(self):
        with pytest.raises(
            PlanError, match="method=qlora needs a CUDA GPU with bitsandbytes"
        ):
            plan(H100, Optimizations(), _config(method="qlora"))


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
        text = run_cli("detect", "--device", "cpu")
        assert (
            "attention  sdpa" in text.stdout and "double_buffered_reload" in text.stdout
        )
