"""Where a product-path step's time goes: the trainer's own run, profiled in process.

``trainer.training.train.run`` is what ``python -m trainer run job.json`` calls; this script calls it in
the same process (the job.json of ``bench.product_path``: the standard workload, every switch on
``auto``) under ``torch.profiler``, whose step boundaries follow the trainer's own ``step``
events, and prints for the profiled window:

- the GPU-busy fraction: the union of the window's kernel / memcpy / memset intervals over its
  wall time (a host-bound step leaves the GPU idle between launches);
- kernels launched per step, and the host ops that cost the most self CPU time;
- with ``--cprofile``, the Python functions with the most cumulative time (cProfile's own
  overhead inflates the host figures: compare runs of the same kind only).

Run on a GPU::

    python -m bench.profile_run --shape qwen3-0.6b [--steps 10] [--profile 3] [--set FIELD=VALUE]
                                [--trace PATH.json] [--cprofile]

``--device cpu --tiny`` runs the same machinery on a tiny Llama (the unit test's smoke run).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.product_path import TINY, job_for, save_model, set_field, write_dataset
from bench.workload import SHAPES, TOKENS_PER_STEP

_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def sync_calls(trace: dict[str, Any]) -> dict[str, int]:
    """How many host-side waits on the GPU the ``ProfilerStep#`` window holds, by runtime call.

    ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` drain everything queued (an ``.item()``
    or a blocking copy does this); ``cudaEventSynchronize`` waits for one recorded point only
    (the trainer's one-step-late read of the previous step's results).
    """
    events = trace.get("traceEvents", [])
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e]
    if not steps:
        return {}
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    found = {name: 0 for name in _SYNC_CALLS}
    for e in events:
        if e.get("name") in found and start <= e.get("ts", -1) <= end:
            found[e["name"]] += 1
    return found


def kernel_ms(trace: dict[str, Any], needle: str) -> float:
    """Milliseconds of the window's kernels whose name holds ``needle`` (e.g. ``nccl``)."""
    events = trace.get("traceEvents", [])
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e]
    if not steps:
        return 0.0
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    return sum(
        e["dur"] for e in events
        if e.get("cat") == "kernel" and needle in str(e.get("name", "")).lower() and start <= e["ts"] <= end
    ) / 1000.0


def busy_fraction(trace: dict[str, Any]) -> tuple[float, float, int]:
    """(GPU-busy fraction, window ms, device events) of a chrome trace's ``ProfilerStep#`` window."""
    events = trace.get("traceEvents", [])
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e]
    if not steps:
        return float("nan"), 0.0, 0
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    spans = sorted(
        (max(e["ts"], start), min(e["ts"] + e["dur"], end))
        for e in events
        if e.get("cat") in _DEVICE_CATEGORIES and "dur" in e and e["ts"] < end and e["ts"] + e["dur"] > start
    )
    busy, reach = 0.0, start
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            busy += hi - lo
            reach = hi
    window = end - start
    return (busy / window if window > 0 else float("nan")), window / 1000.0, len(spans)


def _no_adapter_cache() -> None:
    from trainer.features.lora_kernel import fused as lora_fused

    lora_fused.AdapterCache.watch = lambda self, optimizer: None  # never on: casts in every use


def _no_gc_freeze() -> None:
    import gc

    gc.freeze = lambda: None


def _no_loss_kernel() -> None:
    from trainer.kernels import cross_entropy

    cross_entropy.available = lambda device: False  # the fused loss's torch path per chunk


_WITHOUT = {"adapter-cache": _no_adapter_cache, "gc-freeze": _no_gc_freeze, "loss-kernel": _no_loss_kernel}
"""Savings of the trainer's host path that ``--without`` turns off in this process (an A/B)."""


class _Driver:
    """The ``emit`` the run calls: keeps events, advances the profiler at each step event."""

    def __init__(self, warmup: int, profiled: int, profiler: Any, cprof: cProfile.Profile | None) -> None:
        self.events: list[dict[str, Any]] = []
        self.warmup, self.profiled = warmup, profiled
        self.profiler, self.cprof = profiler, cprof
        self.seen = 0

    def __call__(self, type_: str, **payload: Any) -> dict[str, Any]:
        event = {"type": type_, **payload}
        self.events.append(event)
        if type_ == "step":
            self.seen += 1
            if self.seen == self.warmup:
                self._start()
            elif self.warmup < self.seen <= self.warmup + self.profiled:
                if self.profiler is not None:
                    self.profiler.step()
                if self.seen == self.warmup + self.profiled:
                    self._stop()
        return event

    def _start(self) -> None:
        if self.profiler is not None:
            self.profiler.start()
        if self.cprof is not None:
            self.cprof.enable()

    def _stop(self) -> None:
        if self.cprof is not None:
            self.cprof.disable()
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None


def profile(job: dict[str, Any], warmup: int, profiled: int, trace_path: Path, use_cprofile: bool) -> dict[str, Any]:
    """Run ``job`` in process; the profile of steps ``warmup+1 .. warmup+profiled`` and the events."""
    import torch
    from torch.profiler import ProfilerAction, ProfilerActivity
    from torch.profiler import profile as torch_profile

    from trainer.config import TrainConfig
    from trainer.training.train import run

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # A schedule (always recording) makes profiler.step() mark ``ProfilerStep#`` windows.
    profiler = torch_profile(activities=activities, schedule=lambda _step: ProfilerAction.RECORD) if profiled else None
    cprof = cProfile.Profile() if use_cprofile else None
    driver = _Driver(warmup, profiled, profiler, cprof)
    result = run(TrainConfig.from_dict(job), driver)
    if result.status != "succeeded":
        raise RuntimeError(f"the run ended {result.status}: {result.error_code} {result.message}")
    busy, window_ms, device_events, host, syncs, nccl_ms = float("nan"), 0.0, 0, "", {}, 0.0
    if profiler is not None:
        profiler.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        busy, window_ms, device_events = busy_fraction(trace)
        syncs = {k: v / profiled for k, v in sync_calls(trace).items()}
        nccl_ms = kernel_ms(trace, "nccl") / profiled
        host = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    python = ""
    if cprof is not None:
        out = io.StringIO()
        pstats.Stats(cprof, stream=out).sort_stats("cumulative").print_stats(40)
        python = out.getvalue()
    steps = [e for e in driver.events if e["type"] == "step"]
    timed = steps[warmup:]
    if not timed:  # a rank other than 0 emits no events
        return {}
    return {
        "busy": busy,
        "window_ms": window_ms,
        "device_events_per_step": device_events / max(profiled, 1),
        "step_ms_median": statistics.median(e["step_ms"] for e in timed),
        "tokens_per_s": sum(e["tokens"] for e in timed) / (sum(e["step_ms"] for e in timed) / 1000.0),
        "wall_ms_per_step": window_ms / max(profiled, 1),
        "host_table": host,
        "syncs_per_step": syncs,
        "nccl_kernel_ms_per_step": nccl_ms,
        "python_table": python,
        "plan": next((e for e in driver.events if e["type"] == "plan"), {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", type=int, default=3, help="steps profiled (after the warm-up); 0: timing only")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--workdir", default="/tmp/ftq-product-path")
    parser.add_argument("--trace", help="keep the chrome trace here")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--without", action="append", default=[], choices=sorted(_WITHOUT),
                        help="turn a host-side saving off for an A/B in one call (see _WITHOUT)")
    args = parser.parse_args(argv)
    for name in args.without:
        _WITHOUT[name]()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as `python -m trainer run`
    shape = TINY if args.tiny else SHAPES[args.shape]
    tokens = 512 if args.tiny else TOKENS_PER_STEP
    root = Path(args.workdir) / shape.name
    root.mkdir(parents=True, exist_ok=True)
    model_dir = save_model(shape, root / "model", args.device)
    data = root / "train-profile.jsonl"
    write_dataset(data, model_dir, max(64, args.steps * tokens // 250 * 2))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: every rank profiles its own run
    job = job_for(model_dir, data, Path(tempfile.mkdtemp(prefix="ftq-profile-")), args.steps, args.device, world, tokens)
    for assignment in args.set:
        set_field(job, assignment)
    trace = Path(args.trace or Path(tempfile.mkdtemp(prefix="ftq-trace-")) / "trace.json")
    if world > 1:
        trace = trace.with_name(f"{trace.stem}-rank{os.environ.get('RANK', '0')}{trace.suffix}")
    # only rank 0 emits events, whose steps drive the profiler: the other ranks run unprofiled
    rank0 = os.environ.get("RANK", "0") == "0"
    found = profile(job, args.warmup, args.profile if rank0 else 0, trace, args.cprofile and rank0)
    if not rank0:
        return 0
    label = " ".join(args.set + [f"without {w}" for w in args.without]) or "auto"
    print(f"## {shape.name}, {label}" + (f", rank {os.environ.get('RANK')} of {world}" if world > 1 else ""))
    print(f"tokens/s (step events, after {args.warmup} warm-up steps): {found['tokens_per_s']:,.0f}; "
          f"median step {found['step_ms_median']:.1f} ms; profiled wall {found['wall_ms_per_step']:.1f} ms/step; "
          f"GPU busy {found['busy']:.1%}; device events/step {found['device_events_per_step']:,.0f}; "
          f"host waits/step {found['syncs_per_step']}; NCCL kernels {found['nccl_kernel_ms_per_step']:.1f} ms/step")
    print(found["host_table"])
    if found["python_table"]:
        print(found["python_table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
