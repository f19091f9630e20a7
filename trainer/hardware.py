"""What this machine can do, and which optimizations a run uses on it: ``detect`` then ``plan``.

``detect()`` probes once (cached, never at import) and returns a frozen ``Hardware``.
``plan(hardware, optimizations, config, model)`` is a small pure function from those facts to a
``Plan``: one ``Decision(name, enabled, backend, reason)`` per optimization switch, plus the
attention backend, the loss kernel and the compute dtype. Rules for every switch:

- ``off``  -> disabled, reason "off in the job".
- ``auto`` -> enabled when it can run here and is built; otherwise disabled with the reason.
- ``on``   -> enabled, or ``PlanError`` before any training, naming the hardware and the fix.

What a switch needs is written once in ``_requirement``; which optimizations exist in this build
is ``BUILT_OPTIMIZATIONS`` (the modules that implement them add their name there as they land),
so a plan never claims something the trainer would not actually run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from trainer.config import Optimizations, TrainConfig
from trainer.errors import PlanError

BUILT_OPTIMIZATIONS: frozenset[str] = frozenset()
"""Optimization switches implemented in this build (names of ``trainer.config.Optimizations`` fields)."""

# Dense bf16 tensor-core peak in FLOP/s by GPU name, from the vendors' data sheets (no sparsity).
# Matched by substring in order, so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


@dataclass(frozen=True)
class Hardware:
    device: str
    """``cuda`` or ``cpu``: where training runs."""
    name: str
    """GPU name (``torch.cuda.get_device_name``) or the CPU's description."""
    capability: tuple[int, int] | None
    """CUDA compute capability, None on CPU."""
    gpu_count: int
    gpu_memory: int | None
    """Total memory of the training GPU in bytes, None on CPU."""
    host_memory: int
    """Total host RAM in bytes."""
    pinned_memory: bool
    """Page-locked host buffers can be allocated (needed for asynchronous copies)."""
    bf16: bool
    """The device computes in bfloat16 natively."""
    triton: bool
    """``import triton`` works."""
    attention_kernels: tuple[str, ...]
    """Attention kernels this torch has: ``sdpa`` always, ``flex_attention``, ``varlen``."""
    bitsandbytes: bool
    """``bitsandbytes`` is installed (QLoRA)."""
    cpu_count: int
    torch_version: str
    cuda_version: str | None
    peak_flops: float | None
    """Dense bf16 peak FLOP/s of the GPU when known (for MFU), None on CPU or an unknown GPU."""

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["capability"] = list(self.capability) if self.capability else None
        raw["attention_kernels"] = list(self.attention_kernels)
        return raw

    def describe(self) -> str:
        """One line for messages, e.g. ``NVIDIA H100 80GB HBM3 (cuda, sm90)`` or ``x86_64 (cpu, 2 cores)``."""
        if self.device == "cuda" and self.capability:
            return f"{self.name} (cuda, sm{self.capability[0]}{self.capability[1]})"
        return f"{self.name} (cpu, {self.cpu_count} cores)"


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about the model, read from its config before loading weights."""

    model_type: str
    is_moe: bool = False
    supports_sdpa: bool = True


@dataclass(frozen=True)
class Decision:
    name: str
    enabled: bool
    backend: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    """Compute dtype: ``bfloat16`` on a bf16-capable GPU, else ``float32``."""
    decisions: tuple[Decision, ...]
    attention: Decision
    loss: Decision

    @property
    def attention_backend(self) -> str:
        assert self.attention.backend is not None
        return self.attention.backend

    @property
    def loss_kernel(self) -> str:
        assert self.loss.backend is not None
        return self.loss.backend

    def decision(self, name: str) -> Decision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(
            f"no decision named {name!r}; have {[d.name for d in self.decisions]}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "decisions": [d.to_dict() for d in self.decisions],
            "attention_backend": self.attention_backend,
            "attention_reason": self.attention.reason,
            "loss_kernel": self.loss_kernel,
            "loss_reason": self.loss.reason,
        }


@cache
def detect(device: str = "auto") -> Hardware:
    """Probe the machine once per ``device`` choice (``auto``, ``cpu``, ``cuda``).

    Raises:
        PlanError: ``device="cuda"`` on a machine where torch sees no CUDA device.
    """
    import psutil
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise PlanError(
            "device=cuda: torch sees no CUDA device here; set device to auto or cpu"
        )
    use_cuda = has_cuda and device != "cpu"
    kernels = ["sdpa"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        kernels.append("flex_attention")
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        kernels.append("varlen")
    common = {
        "host_memory": psutil.virtual_memory().total,
        "triton": _importable("triton"),
        "attention_kernels": tuple(kernels),
        "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None,
        "cpu_count": os.cpu_count() or 1,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    }
    if not use_cuda:
        import platform

        return Hardware(
            device="cpu",
            name=platform.processor() or platform.machine() or "cpu",
            capability=None,
            gpu_count=0,
            gpu_memory=None,
            pinned_memory=False,
            bf16=False,
            peak_flops=None,
            **common,
        )
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return Hardware(
        device="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        gpu_count=torch.cuda.device_count(),
        gpu_memory=props.total_memory,
        pinned_memory=_can_pin(),
        bf16=torch.cuda.is_bf16_supported(),
        peak_flops=peak_flops(props.name),
        **common,
    )


def peak_flops(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a GPU name from ``PEAK_BF16_FLOPS``; None if unknown."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in gpu_name.lower():
            return flops
    return None


def plan(
    hw: Hardware,
    opts: Optimizations,
    config: TrainConfig,
    model: ModelFacts | None = None,
) -> Plan:
    """Decide every optimization for a run (see the module docstring for the rules).

    Raises:
        PlanError: a switch is ``on`` but cannot run here, or ``method`` needs what is missing.
    """
    model = model or ModelFacts(model_type="unknown")
    if config.method == "qlora" and not (hw.device == "cuda" and hw.bitsandbytes):
        raise PlanError(
            f"method=qlora needs a CUDA GPU with bitsandbytes installed; this machine is {hw.describe()}"
            f"{'' if hw.bitsandbytes else ' without bitsandbytes'}. Use method=lora, or install bitsandbytes on a GPU worker"
        )
    switches = {
        "packed_metadata_cache": opts.packed_metadata_cache,
        "double_buffered_reload": opts.double_buffered_reload,
        "moe_grouped_routing": opts.moe_grouped_routing,
        "offload_activations": config.offload_activations,
    }
    decisions = tuple(
        _decide(name, value, hw, config, model) for name, value in switches.items()
    )
    return Plan(
        device=hw.device,
        dtype=_dtype(hw, config),
        decisions=decisions,
        attention=_attention(hw, model),
        loss=Decision(
            "loss",
            True,
            "torch_cross_entropy",
            "full logits in float32; no fused loss in this build",
        ),
    )


def _decide(
    name: str, value: str, hw: Hardware, config: TrainConfig, model: ModelFacts
) -> Decision:
    if value == "off":
        return Decision(name, False, None, "off in the job")
    if name == "moe_grouped_routing" and not model.is_moe:
        return Decision(
            name,
            False,
            None,
            f"{model.model_type} has no MoE blocks; the switch has no effect",
        )
    missing = _requirement(name, hw, config)
    if missing is None and name not in BUILT_OPTIMIZATIONS:
        missing = "it is not implemented in this build of the trainer"
    if missing is None:
        return Decision(
            name,
            True,
            hw.device,
            "available here" if value == "auto" else "on in the job",
        )
    if value == "on":
        raise PlanError(
            f"{name}=on cannot run: {missing} (machine: {hw.describe()}). Set {name} to auto or off"
        )
    return Decision(name, False, None, missing)


def _requirement(name: str, hw: Hardware, config: TrainConfig) -> str | None:
    """Why switch ``name`` cannot run on ``hw`` with ``config``, or None when it can."""
    if name in ("double_buffered_reload", "offload_activations"):
        if hw.device != "cuda":
            return "offloading activations needs a CUDA GPU"
        if not hw.pinned_memory:
            return "pinned host memory cannot be allocated on this machine"
        if not config.gradient_checkpointing:
            return "it offloads checkpointed layer inputs, and gradient_checkpointing is off"
        if name == "double_buffered_reload" and config.offload_activations == "off":
            return "offload_activations is off, so there is nothing to reload"
    return None


def _attention(hw: Hardware, model: ModelFacts) -> Decision:
    if not model.supports_sdpa:
        return Decision(
            "attention",
            True,
            "eager",
            f"{model.model_type} has no SDPA path in transformers; eager attention with the packed block mask",
        )
    return Decision(
        "attention",
        True,
        "sdpa",
        "torch SDPA with transformers' block-diagonal mask built from packed position ids",
    )


def _dtype(hw: Hardware, config: TrainConfig) -> str:
    if config.model.dtype != "auto":
        return config.model.dtype
    return "bfloat16" if hw.device == "cuda" and hw.bf16 else "float32"


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken install is as unusable as a missing one
        return False
    return True


def _can_pin() -> bool:
    import torch

    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True
