"""What this machine can do: ``detect()`` probes once and returns a frozen ``Hardware``.

Called by the entry points (``python -m trainer run`` / ``detect``, the bench scripts), never at
import; cached per ``device`` choice. What a run does with these facts is ``trainer.planning``'s
decision (``plan(hardware, config, facts)``), one per optimization, each feature answering
``supported(hardware, facts)`` for itself (``trainer.features``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from functools import cache
from typing import Any

from trainer.errors import PlanError

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
    varlen_options: tuple[str, ...] = ()
    """Keyword options of ``torch.nn.attention.varlen.varlen_attn`` (``window_size``, ``return_aux``):
    a sliding window and attention sinks need them. Empty when torch has no varlen attention."""
    interconnect: str = "none"
    """How this machine's GPUs reach each other: ``NVLink``, ``PCIe (peer-to-peer)``, ``PCIe (through
    host memory)``, ``none`` (one GPU), or ``TCP (gloo)`` on the CPU."""
    triton_varlen: str | None = "not probed"
    """Why our Triton varlen kernel (``trainer.kernels.flash_varlen``) cannot run on the training
    device, or None when it can (any head dim it supports)."""

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


@cache
def detect(device: str = "auto") -> Hardware:
    """Probe the machine once per ``device`` choice (``auto``, ``cpu``, ``cuda``).

    Raises:
        PlanError: ``device="cuda"`` on a machine where torch sees no CUDA device.
    """
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise PlanError(
            "device=cuda: torch sees no CUDA device here; set device to auto or cpu"
        )
    use_cuda = has_cuda and device != "cpu"
    common = _common_facts(use_cuda)
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
            triton_varlen="training runs on the CPU; the Triton kernel needs a CUDA GPU",
            interconnect="TCP (gloo)",
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
        triton_varlen=_triton_varlen_missing(torch.device("cuda", index)),
        interconnect=_interconnect(torch.cuda.device_count()),
        **common,
    )


def _common_facts(use_cuda: bool) -> dict[str, Any]:
    """The facts a CPU and a CUDA ``Hardware`` share (host, libraries, attention kernels)."""
    import psutil
    import torch

    kernels = ["sdpa"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        kernels.append("flex_attention")
    varlen_options = _varlen_options()
    # On CUDA "varlen" is listed only when a tiny real call runs (a build may ship the module
    # without the kernel for this GPU); on CPU it is listed when it imports (no CPU kernel exists).
    if varlen_options is not None and (not use_cuda or _varlen_runs()):
        kernels.append("varlen")
    return {
        "host_memory": psutil.virtual_memory().total,
        "triton": _importable("triton"),
        "attention_kernels": tuple(kernels),
        "varlen_options": varlen_options or (),
        "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None,
        "cpu_count": os.cpu_count() or 1,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    }


def _interconnect(gpu_count: int) -> str:
    """NVLink when ``nvidia-smi nvlink --status`` lists an active link, else PCIe (P2P or not)."""
    import subprocess

    import torch

    if gpu_count < 2:
        return "none"
    try:
        out = subprocess.run(
            ["nvidia-smi", "nvlink", "--status", "-i", "0"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if "GB/s" in out and "inactive" not in out.split("GB/s")[0].lower():
        return "NVLink"
    if torch.cuda.can_device_access_peer(0, 1):
        return "PCIe (peer-to-peer)"
    return "PCIe (through host memory)"


def peak_flops(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a GPU name from ``PEAK_BF16_FLOPS``; None if unknown."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in gpu_name.lower():
            return flops
    return None


def _varlen_options() -> tuple[str, ...] | None:
    """Keyword options of torch's ``varlen_attn``, or None when this torch has none."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - a broken module is as unusable as a missing one
        return None
    params = inspect.signature(varlen_attn).parameters
    return tuple(p for p in ("window_size", "return_aux", "enable_gqa") if p in params)


def _varlen_runs() -> bool:
    """torch's ``varlen_attn`` runs forward and backward on the current CUDA device."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn

        q = torch.randn(
            8, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True
        )
        cu = torch.tensor([0, 3, 8], device="cuda", dtype=torch.int32)
        varlen_attn(q, q, q, cu, cu, 5, 5).sum().backward()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - whatever fails, the kernel is not usable here
        return False
    return True


def _triton_varlen_missing(device: Any) -> str | None:
    try:
        from trainer.kernels import flash_varlen
    except Exception as exc:  # noqa: BLE001 - any import failure makes the kernel unusable
        return f"the Triton varlen kernel does not import: {exc}"
    return flash_varlen.supported(device)


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
