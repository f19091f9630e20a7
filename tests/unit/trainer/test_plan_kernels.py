"""The plan's kernel decisions beside the switches: the LoRA kernel and the fused elementwise ops."""

from __future__ import annotations

import dataclasses

from test_trainer_hardware import CPU, H100, _config

from trainer.config import LoraConfig, Optimizations
from trainer.hardware import plan


def test_fused_lora_by_default_on_cpu_and_gpu() -> None:
    for hw in (CPU, H100):
        p = plan(hw, Optimizations(), _config())
        assert p.lora.enabled and p.lora.backend == "ftq_fused_lora", hw.device
        assert "no fp32 copies" in p.lora.reason
        assert p.to_dict()["lora_kernel"] == "ftq_fused_lora"


def test_lora_dropout_keeps_peft_and_says_why() -> None:
    p = plan(H100, Optimizations(), _config(lora=LoraConfig(dropout=0.1)))
    assert not p.lora.enabled and p.lora.backend == "peft"
    assert "dropout=0.1" in p.lora.reason


def test_full_fine_tuning_has_no_lora_kernel() -> None:
    p = plan(H100, Optimizations(), _config(method="full"))
    assert not p.lora.enabled and p.lora.backend is None and "full" in p.lora.reason


def test_fused_ops_only_on_a_cuda_gpu_with_triton() -> None:
    gpu = plan(H100, Optimizations(), _config())
    assert gpu.fused_ops.enabled and gpu.fused_ops.backend == "triton"
    assert plan(H100, Optimizations(), _config()).to_dict()["fused_ops_reason"].startswith("Triton")
    cpu = plan(CPU, Optimizations(), _config())
    assert not cpu.fused_ops.enabled and "CPU" in cpu.fused_ops.reason
    no_triton = plan(dataclasses.replace(H100, triton=False), Optimizations(), _config())
    assert not no_triton.fused_ops.enabled and "triton is not installed" in no_triton.fused_ops.reason


def test_fused_ops_off_below_sm80() -> None:
    v100 = dataclasses.replace(H100, name="Tesla V100-SXM2-32GB", capability=(7, 0))
    p = plan(v100, Optimizations(), _config())
    assert not p.fused_ops.enabled and "sm70" in p.fused_ops.reason and "sm80" in p.fused_ops.reason
