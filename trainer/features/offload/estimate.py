"""What offloaded checkpointing costs, for the plan: layer-input bytes and the memory limits.

``estimate`` gives the bytes of one micro-batch's checkpointed layer inputs (on the GPU with
plain checkpointing, in pinned host memory with offload, one reload buffer); the constants are
the headroom the plan keeps on the host and the GPU; ``machine_missing``, ``host_too_small`` and
``policy_unavailable`` are the rules the offload feature and the activation policy share. No
device is touched: the plan passes the
free memory ``trainer.plan.hardware`` detected (``host_available_bytes`` and ``is_wsl`` read ``/proc``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.plan.hardware import Hardware
from trainer.plan.types import ModelFacts

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_GIB = 1 << 30
HOST_HEADROOM_BYTES = 2 * _GIB
"""Host memory left free beyond the offloaded inputs (data loader, Python, CUDA's own pinned pools)."""
DOUBLE_BUFFER_HEADROOM_BYTES = 512 << 20
"""GPU memory that must stay free next to the second buffer (Unsloth uses the same 512 MiB)."""
WSL_PINNED_LIMIT_BYTES = 1 * _GIB
"""WSL2 caps pinned allocations around 1-2 GB and fails with a bare CUDA OOM (Unsloth #1552, #1744)."""


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes of the checkpointed layer inputs of one micro-batch, and where they live with offload."""

    checkpointed: int
    """On the GPU with plain gradient checkpointing: every layer's input (``L x T x H``)."""
    offloaded: int
    """Pinned host memory offload needs: every layer's input but the last (``(L-1) x T x H``)."""
    buffer: int
    """One GPU reload buffer (``T x H``); single buffering needs one, double buffering two."""
    second_buffer: int
    """Extra GPU memory double buffering costs over single buffering (= ``buffer``)."""


def _itemsize(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if dtype not in _DTYPE_BYTES:
        raise ValueError(
            f"dtype {dtype!r}: use one of {', '.join(_DTYPE_BYTES)} or a torch.dtype"
        )
    return _DTYPE_BYTES[dtype]


def estimate(config: Any, tokens: int, dtype: torch.dtype | str) -> ActivationEstimate:
    """Layer-input bytes for a model config (HF ``PretrainedConfig`` or anything with
    ``num_hidden_layers`` and ``hidden_size``) at ``tokens`` tokens per micro-batch.

    Raises:
        ValueError: ``tokens`` < 1, or the config lacks the two sizes.
    """
    if tokens < 1:
        raise ValueError(f"tokens: must be >= 1, got {tokens}")
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not hidden:
        raise ValueError(
            f"{type(config).__name__} has no num_hidden_layers/hidden_size; pass a decoder-only model config"
        )
    one = tokens * hidden * _itemsize(dtype)
    return ActivationEstimate(
        checkpointed=layers * one,
        offloaded=(layers - 1) * one,
        buffer=one,
        second_buffer=one,
    )


def is_wsl() -> bool:
    """True inside WSL2 (its pinned-memory cap: ``WSL_PINNED_LIMIT_BYTES``)."""
    try:
        with open("/proc/version", encoding="utf-8") as f:
            return "microsoft" in f.read().lower()
    except OSError:
        return False


def double_buffer_supported(
    gpu_free_bytes: int, second_buffer_bytes: int
) -> str | None:
    """Why the second reload buffer does not fit on the GPU, or None when it does."""
    if second_buffer_bytes + DOUBLE_BUFFER_HEADROOM_BYTES > gpu_free_bytes:
        return (
            f"the second reload buffer needs {second_buffer_bytes / _GIB:.2f} GiB plus "
            f"{DOUBLE_BUFFER_HEADROOM_BYTES >> 20} MiB headroom and only {gpu_free_bytes / _GIB:.2f} GiB "
            "of GPU memory is free; the reload stays single-buffered"
        )
    return None


ACTIVATION_SHARE = 0.5
"""``auto`` offloads when the checkpointed layer inputs would take more than this share of the GPU
memory left after the weights: the rest is for one layer's recompute, the loss and the optimizer.
The decision itself is the plan's (pure, from the model facts and the hardware)."""


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the host memory the plan's offload check compares against); 0 if unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class _Shape:
    """The two sizes ``estimate`` reads from a model config."""

    num_hidden_layers: int
    hidden_size: int


def machine_missing(hw: Hardware) -> str | None:
    """Why offloading cannot run on ``hw`` (for any model), or None."""
    if hw.device != "cuda":
        return "offloading activations needs a CUDA GPU"
    if not hw.pinned_memory:
        return "pinned host memory cannot be allocated on this machine"
    return None


def estimate_for(facts: ModelFacts, tokens: int, dtype: str) -> ActivationEstimate | None:
    """``estimate`` for a model's facts; None when its layer count or hidden size is unknown."""
    if not (facts.num_layers and facts.hidden_size):
        return None
    return estimate(_Shape(facts.num_layers, facts.hidden_size), tokens, dtype)


def host_too_small(est: ActivationEstimate, hw: Hardware) -> str | None:
    """Why the host cannot hold the offloaded inputs (plus ``HOST_HEADROOM_BYTES``), or None."""
    need = est.offloaded + HOST_HEADROOM_BYTES
    if need <= hw.host_memory:
        return None
    return (
        f"offload needs {est.offloaded / _GIB:.1f} GiB of pinned host memory plus "
        f"{HOST_HEADROOM_BYTES / _GIB:.0f} GiB headroom and the host has "
        f"{hw.host_memory / _GIB:.1f} GiB"
    )


def policy_unavailable(hw: Hardware, facts: ModelFacts, tokens: int, dtype: str, sharded: bool) -> str | None:
    """Why the activation policy cannot pick ``full+offload`` for this job, or None when it can."""
    missing = machine_missing(hw)
    if missing is None and sharded:
        missing = "the layers are sharded with FSDP2"
    est = estimate_for(facts, tokens, dtype) if missing is None else None
    if est is not None:
        missing = host_too_small(est, hw)
    return missing
