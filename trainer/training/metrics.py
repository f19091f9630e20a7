"""Step timing, throughput, MFU and memory for ``step`` events, without stalling the GPU.

On CUDA every phase (data, forward, backward, optimizer) is bracketed by CUDA events recorded on
the current stream; the loop reads a step's timings, loss and grad norm only after it has queued
the next step, so waiting on the old step's last event never leaves the GPU idle and no
``synchronize()`` exists just to measure. On CPU the same interface uses ``time.perf_counter``.

MFU is ``trainer.training.flops``'s model FLOPs of the step (``FlopCounter``, re-exported here: frozen
matmul weights 4 FLOPs per parameter per token, trainable ones 6, LoRA's own matmuls, in-sample
causal attention; no recompute) over the step time and the peak the plan names
(``Hardware.peak_flops``, from ``Hardware.peak_source``: measured once per GPU and cached, or the
datasheet value labelled as such).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from trainer.training.flops import FlopCounter  # noqa: F401 - re-exported: the step builds its counter through here

PHASES = ("data", "forward", "backward", "optimizer")


class StepTimer:
    """Times the phases of one optimizer step; ``finish()`` hands back a ``PendingTiming``."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._spans: list[tuple[str, Any, Any]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._cuda:
            start, end = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._spans.append((name, start, end))

    def finish(self) -> PendingTiming:
        spans, self._spans = self._spans, []
        return PendingTiming(spans, self._cuda)


def param_numel(p: torch.Tensor) -> int:
    """How many weights ``p`` stands for: a bitsandbytes 4-bit weight stores two per byte and keeps
    its logical shape in ``quant_state``, so ``numel()`` would count half of them."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


@dataclass
class PendingTiming:
    spans: list[tuple[str, Any, Any]]
    cuda: bool

    def read(self) -> dict[str, float]:
        """``{step_ms, data_ms, forward_ms, backward_ms, optimizer_ms}``; on CUDA waits for the step's last event."""
        if not self.spans:
            return {"step_ms": 0.0, **{f"{p}_ms": 0.0 for p in PHASES}}
        totals: dict[str, float] = defaultdict(float)
        if self.cuda:
            self.spans[-1][2].synchronize()
            for name, start, end in self.spans:
                totals[name] += start.elapsed_time(end)
            step_ms = self.spans[0][1].elapsed_time(self.spans[-1][2])
        else:
            for name, start, end in self.spans:
                totals[name] += (end - start) * 1000.0
            step_ms = (self.spans[-1][2] - self.spans[0][1]) * 1000.0
        return {"step_ms": step_ms, **{f"{p}_ms": totals.get(p, 0.0) for p in PHASES}}


def memory_stats(device: torch.device, retries_at_start: int | None = None) -> dict[str, int | None]:
    """GPU allocated/reserved/peak bytes and the step's allocator retries (host-side counters, no
    sync) and host RSS.

    ``gpu_alloc_retries`` is how many times the caching allocator retried during the step: the
    counter now minus ``retries_at_start`` (``reset_peak_memory``'s result at the step's start);
    None without CUDA or without a start.
    """
    import psutil

    rss = psutil.Process().memory_info().rss
    if device.type != "cuda":
        return {
            "gpu_mem_allocated": None,
            "gpu_mem_reserved": None,
            "gpu_mem_peak": None,
            "gpu_alloc_retries": None,
            "host_rss": rss,
        }
    retries = alloc_retries(device)
    return {
        "gpu_mem_allocated": torch.cuda.memory_allocated(device),
        "gpu_mem_reserved": torch.cuda.memory_reserved(device),
        "gpu_mem_peak": torch.cuda.max_memory_allocated(device),
        "gpu_alloc_retries": None if retries is None or retries_at_start is None else retries - retries_at_start,
        "host_rss": rss,
    }


def reset_peak_memory(device: torch.device) -> int | None:
    """Start a step's memory window: reset the peak; returns the allocator's retry count so far
    (``memory_stats``' ``retries_at_start``), None without CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)  # the peaks only: the retry counter is cumulative
    return alloc_retries(device)


def alloc_retries(device: torch.device) -> int | None:
    """The CUDA caching allocator's retries on ``device`` since the process started (a host-side
    counter, no sync); None without CUDA.

    A retry is an allocation that found no cached block and failed in ``cudaMalloc``: the allocator
    then frees every unused cached block (a device sync) and tries again, a stall near the memory
    cap that the step's time shows and its memory does not (on an H200 with queued matmuls, one
    retried 3 GiB allocation held the host 0.54 s). ``reset_peak_memory_stats`` leaves the count.
    """
    if device.type != "cuda":
        return None
    # The nested dict holds the counter at its top level: 13 us a call on an H200 (torch 2.11),
    # where memory_stats() flattens 122 keys in 93 us.
    return torch.cuda.memory_stats_as_nested_dict(device).get("num_alloc_retries")


def mfu(flops: float, step_ms: float, peak_flops: float | None) -> float | None:
    """Achieved model FLOP/s over the device's peak (``Hardware.peak_flops``); None where the peak is unknown (CPU)."""
    if peak_flops is None or step_ms <= 0:
        return None
    return flops / (step_ms / 1000.0) / peak_flops
