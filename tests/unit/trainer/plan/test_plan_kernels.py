"""The plan's kernel decisions beside the switches: the LoRA kernel and the fused elementwise ops."""

from __future__ import annotations

import dataclasses

from plan_fakes import CPU, H100, plan_config

from trainer.config import LoraConfig
from trainer.plan.planner import plan


def test_fused_lora_by_default_on_cpu_and_gpu() -> None:
    for hw in (CPU, H100):
        p = plan(hw, plan_config())
        lora = p.decision("lora_kernel")
        assert lora.enabled and lora.backend == "ftq_fused_lora", hw.device
        assert lora.requested == "auto"
        assert "no fp32 copies" in lora.reason
        event = {d["name"]: d for d in p.to_dict()["decisions"]}
        assert event["lora_kernel"]["backend"] == "ftq_fused_lora"


def test_lora_dropout_keeps_peft_and_says_why() -> None:
    lora = plan(H100, plan_config(lora=LoraConfig(dropout=0.1))).decision("lora_kernel")
    assert not lora.enabled and lora.backend == "peft"
    assert "dropout=0.1" in lora.reason


def test_full_fine_tuning_has_no_lora_kernel() -> None:
    lora = plan(H100, plan_config(method="full")).decision("lora_kernel")
    assert not lora.enabled and lora.backend is None and "full" in lora.reason


def test_fused_ops_only_on_a_cuda_gpu_with_triton() -> None:
    gpu = plan(H100, plan_config())
    ops = gpu.decision("fused_ops")
    assert ops.enabled and ops.backend == "triton"
    event = {d["name"]: d for d in gpu.to_dict()["decisions"]}
    assert event["fused_ops"]["reason"].startswith("Triton")
    cpu = plan(CPU, plan_config()).decision("fused_ops")
    assert not cpu.enabled and "CPU" in cpu.reason
    no_triton = plan(dataclasses.replace(H100, triton=False), plan_config()).decision("fused_ops")
    assert not no_triton.enabled and "triton is not installed" in no_triton.reason


def test_fused_ops_off_below_sm80() -> None:
    v100 = dataclasses.replace(H100, name="Tesla V100-SXM2-32GB", capability=(7, 0))
    ops = plan(v100, plan_config()).decision("fused_ops")
    assert not ops.enabled and "sm70" in ops.reason and "sm80" in ops.reason
