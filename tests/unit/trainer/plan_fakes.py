"""Fake machines and jobs for the plan tests (imported by name: pytest puts this folder on sys.path).

``trainer.plan.planner.plan`` is pure, so a hand-written ``Hardware`` exercises the GPU branches on
a CPU box; ``plan_config`` is a job whose paths are never read.
"""

from __future__ import annotations

import dataclasses

from trainer.config import (
    SWITCHES,
    DataConfig,
    ModelConfig,
    OptimConfig,
    Optimizations,
    TrainConfig,
)
from trainer.plan.hardware import Hardware

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


def plan_config(**kw: object) -> TrainConfig:
    """A one-step job for ``plan``; switch names (``offload_activations="on"``) go into its
    ``optimizations``, the other keywords replace ``TrainConfig`` fields."""
    switches = {name: kw.pop(name) for name in SWITCHES if name in kw}
    if switches:
        base = kw.get("optimizations", Optimizations())
        kw["optimizations"] = dataclasses.replace(base, **switches)  # type: ignore[arg-type]
    return TrainConfig(
        **{  # type: ignore[arg-type]
            "model": ModelConfig("m"),
            "data": DataConfig("t"),
            "optim": OptimConfig(max_steps=1),
            "output_dir": "o",
            **kw,
        }
    )
