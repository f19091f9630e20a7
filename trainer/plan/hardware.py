"""What this machine can do: ``detect()`` probes once and returns a frozen ``Hardware``.

Called by the entry points (``python -m trainer run`` / ``detect``, the bench scripts), never at
import; cached per ``device`` choice. What a run does with these facts is ``trainer.plan.planner``'s
decision (``plan(hardware, config, facts)``), one per optimization, each feature answering
``supported(hardware, facts)`` for itself (``trainer.features``).

The peak MFU is measured against (``Hardware.peak_flops``, named by ``Hardware.peak_source``):
on a CUDA device, the dense bf16 matmul rate measured once per GPU model and torch version and
cached in ``~/.cache/ftq/peak-<gpu name>-<torch version>.json`` (``$XDG_CACHE_HOME/ftq`` when
set). The first ``detect()`` on a device without a cache file measures it (``measure_peak_flops``:
3 + 20 bf16 matmuls of 8192^3, about 50 ms on an H100, before the model loads, never in the step
loop) and writes the file; ``python -m trainer detect --measure-peak`` measures again and
overwrites it (after a driver or clock change, or when the first measurement ran on a busy GPU).
A measurement under half the datasheet value is taken for a busy GPU: it is not cached and the
datasheet value is used. Where nothing can be measured or written the datasheet value of
``PEAK_BF16_FLOPS`` is used, labelled ``spec: <GPU> datasheet dense bf16``; on the CPU there is no
peak (no MFU). The bench scripts read the same ``detect().peak_flops``.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from trainer.errors import PlanError
from trainer.model.imports import installed

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
PEAK_MATMUL_N = 8192
"""Side of the square bf16 matmul ``measure_peak_flops`` times."""
PEAK_MATMUL_REPS = 20


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
    """Dense bf16 peak FLOP/s of the GPU, what MFU divides by; None on CPU (or an unknown GPU that
    could not be measured)."""
    varlen_options: tuple[str, ...] = ()
    """Keyword options of ``torch.nn.attention.varlen.varlen_attn`` (``window_size``, ``return_aux``):
    a sliding window and attention sinks need them. Empty when torch has no varlen attention."""
    interconnect: str = "none"
    """How this machine's GPUs reach each other: ``NVLink``, ``PCIe (peer-to-peer)``, ``PCIe (through
    host memory)``, ``none`` (one GPU), or ``TCP (gloo)`` on the CPU."""
    triton_varlen: str | None = "not probed"
    """Why our Triton varlen kernel (``trainer.kernels.attention``) cannot run on the training
    device, or None when it can (any head dim it supports)."""
    peak_source: str | None = None
    """Where ``peak_flops`` comes from: ``measured: 8192^3 bf16 matmul, <date>`` (cached per GPU
    model and torch version) or ``spec: <GPU> datasheet dense bf16``; None without a peak."""

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
    peak, peak_source = device_peak(
        props.name, torch.__version__, measure=lambda: measure_peak_flops(torch.device("cuda", index))
    )
    return Hardware(
        device="cuda",
        name=props.name,
        capability=(props.major, props.minor),
        gpu_count=torch.cuda.device_count(),
        gpu_memory=props.total_memory,
        pinned_memory=_can_pin(),
        bf16=torch.cuda.is_bf16_supported(),
        peak_flops=peak,
        peak_source=peak_source,
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
    varlen_options = _varlen_options(imported=use_cuda)
    # On CUDA "varlen" is listed only when a tiny real call runs (a build may ship the module
    # without the kernel for this GPU); on CPU it is listed when it imports (no CPU kernel exists).
    if varlen_options is not None and (not use_cuda or _varlen_runs()):
        kernels.append("varlen")
    return {
        "host_memory": psutil.virtual_memory().total,
        "triton": _importable("triton"),
        "attention_kernels": tuple(kernels),
        "varlen_options": varlen_options or (),
        "bitsandbytes": installed("bitsandbytes"),  # metadata: a LoRA run marks the module absent
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
    spec = _spec_peak(gpu_name)
    return spec[1] if spec else None


def _spec_peak(gpu_name: str) -> tuple[str, float] | None:
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in gpu_name.lower():
            return key, flops
    return None


def measure_peak_flops(device: Any, n: int = PEAK_MATMUL_N, reps: int = PEAK_MATMUL_REPS) -> float:
    """bf16 FLOP/s of ``reps`` square ``n``-sized matmuls on a CUDA ``device`` (after 3 warm-up ones).

    Frees what it allocated (3 x 128 MiB at n=8192) so the memory a run sees at start is unchanged.
    """
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 * reps / seconds


def peak_cache_path(gpu_name: str, torch_version: str, cache_dir: Path | None = None) -> Path:
    """``<cache_dir>/peak-<gpu name>-<torch version>.json`` (characters other than ``[A-Za-z0-9.]`` -> ``-``)."""
    root = cache_dir or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftq"
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{gpu_name}-{torch_version}").strip("-")
    return root / f"peak-{slug}.json"


def device_peak(
    gpu_name: str,
    torch_version: str,
    measure: Callable[[], float] | None = None,
    *,
    remeasure: bool = False,
    cache_dir: Path | None = None,
) -> tuple[float | None, str | None]:
    """``(peak FLOP/s, its source)`` for a GPU: the cached measurement, else ``measure()`` (cached),
    else the datasheet value (module docstring). ``remeasure`` ignores the cache file.

    Args:
        measure: returns the device's FLOP/s (``measure_peak_flops`` on it); None where nothing can
            be measured. A measurement that fails (out of memory on a full GPU) falls back too.
    """
    path = peak_cache_path(gpu_name, torch_version, cache_dir)
    cached = None if remeasure else _read_peak(path)
    if cached is not None:
        return cached
    spec = _spec_peak(gpu_name)
    spec_source = f"spec: {spec[0]} datasheet dense bf16" if spec else None
    try:
        measured = measure() if measure is not None else None
    except RuntimeError:  # torch.OutOfMemoryError included: another process holds the GPU
        measured = None
    if measured is None:
        return (spec[1], spec_source) if spec else (None, None)
    if spec and measured < spec[1] / 2:
        return spec[1], f"{spec_source} (measured {measured / 1e12:.0f} TFLOP/s, under half of it: a busy GPU?)"
    source = f"measured: {PEAK_MATMUL_N}^3 bf16 matmul, {datetime.date.today().isoformat()}"
    _write_peak(path, {"gpu": gpu_name, "torch": torch_version, "peak_flops": measured, "source": source})
    return measured, source


def remeasure_peak() -> tuple[float | None, str | None]:
    """Measure the current CUDA device again and overwrite its cache file (``trainer detect --measure-peak``).

    Raises:
        PlanError: torch sees no CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise PlanError("--measure-peak needs a CUDA device; torch sees none here (the CPU has no MFU)")
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    return device_peak(
        name, torch.__version__, lambda: measure_peak_flops(torch.device("cuda", index)), remeasure=True
    )


def _read_peak(path: Path) -> tuple[float, str] | None:
    try:
        raw = json.loads(path.read_text())
        return float(raw["peak_flops"]), str(raw["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_peak(path: Path, record: dict[str, Any]) -> None:
    """Atomically (ranks of one job may write at once); an unwritable cache only costs a re-measure."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def _varlen_options(*, imported: bool = True) -> tuple[str, ...] | None:
    """Keyword options of torch's ``varlen_attn``, or None when this torch has none.

    ``imported=False`` (a CPU, where no varlen kernel runs and only the listing needs it) reads the
    signature from the module's source instead of importing it: the import pulls in
    ``torch._dynamo`` (~1.5 s of CPU), which ``python -m trainer detect`` at every worker start
    would pay for a line of the hardware facts."""
    import inspect

    if not imported:
        return _varlen_source_options()
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - a broken module is as unusable as a missing one
        return None
    params = inspect.signature(varlen_attn).parameters
    return tuple(p for p in ("window_size", "return_aux", "enable_gqa") if p in params)


def _varlen_source_options() -> tuple[str, ...] | None:
    """``_varlen_options`` read from ``torch/nn/attention/varlen.py``'s ``def varlen_attn``."""
    import ast

    try:
        spec = importlib.util.find_spec("torch.nn.attention.varlen")
        source = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else None
        tree = ast.parse(source) if source else None
    except (ImportError, OSError, SyntaxError, ValueError):
        return None
    found = next((node for node in (tree.body if tree else ()) if isinstance(node, ast.FunctionDef)
                  and node.name == "varlen_attn"), None)
    if found is None:
        return None
    args = found.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    return tuple(p for p in ("window_size", "return_aux", "enable_gqa") if p in names)


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
        from trainer.kernels import attention as attention_kernel
    except Exception as exc:  # noqa: BLE001 - any import failure makes the kernel unusable
        return f"the Triton varlen kernel does not import: {exc}"
    return attention_kernel.supported(device)


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
