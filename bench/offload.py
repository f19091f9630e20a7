"""Offloaded checkpointing on a GPU: plain checkpointing vs offload with a synchronous reload vs offload
with the double-buffered reload (``trainer.features.offload``), on the standard workload.

Run on the lent GPU: ``python -m bench.offload [--shapes llama-8b qwen3-14b] [--json PATH]``.
With ``$OUT`` set (or ``--trace-dir``) it writes a chrome trace of one double-buffered step per
shape (``offload_double_<shape>.json``, open in chrome://tracing or Perfetto) and the overlap
summaries of both offload variants.

Workload (bench/workload.py): random-weight bf16 models from config classes, LoRA r=16 on every
projection, one packed micro-batch of 16,384 real tokens per step, AdamW on the adapters. Each
variant is a plan (``bench.plans``, installed by ``trainer.training.install.install`` and removed after
it): ``offload_activations`` and ``double_buffered_reload`` as the variant says, ``ftq_packed``
attention on the kernel the plan chooses (printed) with cached metadata, the plan's loss, and
peft's LoRA forward with transformers' norm and MLP (``lora_kernel`` and ``fused_ops`` off, what
this bench has always measured around the offload).

Per shape, in one process on the same model object:
1. Gradients: one fixed batch, fresh grads, no optimizer step, for ``checkpoint`` (twice: the
   run-to-run noise of the GPU kernels), ``offload sync`` and ``offload double``; max relative
   difference of every LoRA gradient against the first checkpoint run, and whether all are
   bit-identical.
2. Timing: ``--warmup`` steps, then ``--steps`` steps timed by wall clock around a synchronize
   (step ms, tokens/s), peak ``max_memory_allocated`` over the timed steps, host syncs of one
   step under ``torch.cuda.set_sync_debug_mode("warn")``, the second buffer's bytes.
3. Profile: one more step of each offload variant under ``torch.profiler``; ``overlap_summary``
   reads the trace: how much of the H2D reload copies (on the side stream) ran while the main
   stream was computing. Double buffering should hide most of it; the synchronous reload none.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.plans import Planner, attention_line, ftq_loss
from bench.qlora import QWEN3_14B
from bench.workload import (
    LLAMA_3_1_8B,
    TOKENS_PER_STEP,
    ModelShape,
    build_lora_model,
    packed_batch,
    packed_steps,
)
from trainer.training.install import Installation, install
from trainer.features.offload import estimate

SHAPES = {"llama-8b": LLAMA_3_1_8B, "qwen3-14b": QWEN3_14B}
VARIANTS = ("checkpoint", "offload sync", "offload double")


@dataclass
class Result:
    shape: str
    variant: str
    status: str = "ok"
    step_ms: float = float("nan")
    tokens_per_s: float = float("nan")
    peak_gib: float = float("nan")
    second_buffer_gib: float = 0.0
    syncs_per_step: int = -1
    grad_max_rel_diff: float = float("nan")
    grads_bitwise: bool | None = None
    overlap: dict[str, Any] = field(default_factory=dict)
    installed: list[str] = field(default_factory=list)
    """The variant's plan as installed (``Installation.describe()``)."""


# -- trace reading (also used by tests/gpu/test_offload_gpu.py) ------------------------------------


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def overlap_summary(trace_path: str | Path) -> dict[str, Any]:
    """How much of the offload copies ran while the main stream computed, from a chrome trace.

    The main stream is the one with the most kernel time; offload copies are the ``gpu_memcpy``
    events on other streams (HtoD = reloads in backward, DtoH = offloads in forward). Times in ms.
    """
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    kernels: dict[Any, list[tuple[float, float]]] = {}
    copies: list[tuple[str, Any, float, float]] = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        stream = e.get("args", {}).get("stream")
        interval = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "kernel":
            kernels.setdefault(stream, []).append(interval)
        elif e.get("cat") == "gpu_memcpy":
            kind = (
                "h2d"
                if "HtoD" in e.get("name", "")
                else "d2h"
                if "DtoH" in e.get("name", "")
                else "other"
            )
            copies.append((kind, stream, *interval))
    if not kernels:
        raise ValueError(
            f"{trace_path}: no GPU kernels in the trace; was the profiler run with CUDA activity?"
        )
    main = max(kernels, key=lambda s: sum(b - a for a, b in kernels[s]))
    union = _merge(kernels[main])
    summary: dict[str, Any] = {
        "main_stream": main,
        "kernel_ms": sum(b - a for a, b in union) / 1e3,
    }
    for kind in ("h2d", "d2h"):
        side = [(a, b) for k, s, a, b in copies if k == kind and s != main]
        total = sum(b - a for a, b in side)
        hidden = sum(_covered(c, union) for c in side)
        summary[kind] = {
            "copies": len(side),
            "copy_ms": total / 1e3,
            "overlapped_ms": hidden / 1e3,
            "overlapped_fraction": hidden / total if total else 0.0,
            "streams": sorted(
                {str(s) for k, s, _, _ in copies if k == kind and s != main}
            ),
        }
    return summary


def profile_step(step: Any, trace_path: Path) -> dict[str, Any]:
    """Run ``step()`` once under torch.profiler, write the chrome trace, return its overlap summary."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # CUDA activity only: kernels, copies and their streams are all the summary reads, and the
    # trace of an 8B step stays a few MB instead of tens with every aten op on the CPU side.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_path))
    return overlap_summary(trace_path)


# -- the benchmark ------------------------------------------------------------------------------


SWITCHES = {
    "checkpoint": {"offload_activations": "off", "double_buffered_reload": "off"},
    "offload sync": {"offload_activations": "on", "double_buffered_reload": "off"},
    "offload double": {"offload_activations": "on", "double_buffered_reload": "on"},
}
"""Each variant's plan: the bench job (``bench.plans``) with these switches."""
KERNELS_OFF = ("lora_kernel", "fused_ops")
"""What this bench has always measured around the offload: packed attention (metadata cached) and
the fused loss over peft's LoRA and transformers' norm and MLP, so its figures stay comparable."""


class Runner:
    """One shape's model and its plans; ``installed(variant)`` applies one, ``step`` runs fwd+bwd+optimizer."""

    def __init__(self, shape: ModelShape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        self.model, self.optimizer = build_lora_model(shape, device)
        self.planner = Planner.for_model(self.model, shape, device)
        self.installation: Installation | None = None
        print(f"# {shape.name}: {attention_line(self.planner.default)}", file=sys.stderr)

    @contextlib.contextmanager
    def installed(self, variant: str) -> Iterator[Installation]:
        """``variant``'s plan installed on the model for the block, removed after it."""
        self.installation = install(self.model, self.planner.plan(KERNELS_OFF, **SWITCHES[variant]))
        try:
            yield self.installation
        finally:
            self.installation.remove()
            self.installation = None

    def backward(self, lengths: list[int], seed: int) -> torch.Tensor:
        assert self.installation is not None, "install a variant first (Runner.installed)"
        batch = packed_batch(lengths, self.shape.vocab, self.device, seed)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = ftq_loss(self.installation, self.model, batch, self.device)
        loss.backward()
        return loss.detach()

    def step(self, lengths: list[int], seed: int) -> torch.Tensor:
        loss = self.backward(lengths, seed)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def lora_grads(self) -> dict[str, torch.Tensor]:
        return {
            n: p.grad.detach().clone()
            for n, p in self.model.named_parameters()
            if p.grad is not None
        }


def compare_grads(
    reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]
) -> tuple[float, bool]:
    """(max over parameters of max|a-b| / max|a|, all bit-identical); NaN when any gradient is NaN.

    NaN-aware on purpose: Python's ``max(0.0, nan)`` is ``0.0``, which once reported NaN
    gradients as "max rel diff 0.0e+00 but not bitwise".
    """
    if reference.keys() != other.keys():
        raise ValueError("the two runs trained different parameters")
    worst, bitwise = 0.0, True
    for name, ref in reference.items():
        got = other[name]
        bitwise &= torch.equal(ref, got)
        scale = ref.abs().max().item() or 1.0
        rel = (ref.float() - got.float()).abs().max().item() / scale
        worst = math.nan if math.isnan(rel) or math.isnan(worst) else max(worst, rel)
    return worst, bitwise


def _empty_cache() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def gradients(runner: Runner, lengths: list[int], results: dict[str, Result]) -> None:
    """1. LoRA gradients of one fixed batch per variant (fresh grads, no optimizer step) against
    a first plain-checkpointing run; the ``checkpoint`` row is a rerun of it (the kernels' noise)."""
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for variant in ("checkpoint", "checkpoint again", "offload sync", "offload double"):
        with runner.installed(variant.replace(" again", "")):
            runner.optimizer.zero_grad(set_to_none=True)
            runner.backward(lengths, seed=0)
            grads[variant] = runner.lora_grads()
            runner.optimizer.zero_grad(set_to_none=True)
    noise, noise_bitwise = compare_grads(grads["checkpoint"], grads["checkpoint again"])
    print(
        f"# {runner.shape.name}: checkpoint vs checkpoint again: max rel diff {noise:.2e}, bitwise {noise_bitwise}",
        file=sys.stderr,
    )
    for variant in VARIANTS:
        source = "checkpoint again" if variant == "checkpoint" else variant
        results[variant].grad_max_rel_diff, results[variant].grads_bitwise = compare_grads(
            grads["checkpoint"], grads[source]
        )
    del grads
    _empty_cache()


def time_variant(
    runner: Runner, variant: str, result: Result, steps: list[list[int]], args: argparse.Namespace,
    trace_dir: Path | None,
) -> None:
    """2. Timing and host syncs of ``variant``'s plan; 3. a profiled step of an offload variant."""
    device = runner.device
    with runner.installed(variant) as installation:
        for i in range(args.warmup):
            runner.step(steps[i], seed=i)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                runner.step(steps[args.warmup], seed=args.warmup)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result.syncs_per_step = sum("synchroniz" in str(w.message) for w in caught)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        timed = range(args.warmup + 1, args.warmup + 1 + args.steps)
        wall = time.perf_counter()
        for i in timed:
            runner.step(steps[i], seed=i)
        torch.cuda.synchronize()
        wall = time.perf_counter() - wall
        result.step_ms = wall * 1e3 / len(timed)
        result.tokens_per_s = sum(sum(steps[i]) for i in timed) / wall
        result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
        result.installed = installation.describe()
        if variant == "checkpoint":
            return
        result.second_buffer_gib = installation.offloader.extra_gpu_bytes / 2**30
        if trace_dir is not None:
            path = trace_dir / f"{variant.replace(' ', '_')}_{runner.shape.name}.json"
            result.overlap = profile_step(lambda: runner.step(steps[-1], seed=999), path)
            if variant != "offload double":
                path.unlink()  # keep only the double-buffered trace; its summary stays in the table


def run_shape(
    shape: ModelShape,
    args: argparse.Namespace,
    device: torch.device,
    trace_dir: Path | None,
) -> list[Result]:
    runner = Runner(shape, device)
    steps = packed_steps(args.warmup + args.steps + 2, seed=0)
    results = {v: Result(shape.name, v) for v in VARIANTS}
    gradients(runner, steps[0], results)  # before any optimizer step changes the weights
    for variant in VARIANTS:
        try:
            time_variant(runner, variant, results[variant], steps, args, trace_dir)
        except torch.OutOfMemoryError as exc:
            results[variant].status = f"OOM: {str(exc).splitlines()[0]}"
        finally:
            runner.optimizer.zero_grad(set_to_none=True)
            _empty_cache()
    runner.model = runner.optimizer = None
    _empty_cache()
    return list(results.values())


def markdown(results: list[Result], device_name: str) -> str:
    lines = [
        f"Offloaded checkpointing, {device_name}, {TOKENS_PER_STEP:,} tokens/step, bf16, LoRA r=16",
        "",
        (
            "| shape | variant | step ms | tokens/s | vs sync | peak GiB | 2nd buffer GiB | H2D hidden | "
            "syncs/step | grad max rel diff | bitwise |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    sync = {r.shape: r for r in results if r.variant == "offload sync"}
    for r in results:
        base = sync.get(r.shape)
        ratio = (
            (r.tokens_per_s / base.tokens_per_s)
            if base and base.tokens_per_s == base.tokens_per_s
            else float("nan")
        )
        hidden = r.overlap.get("h2d", {}).get("overlapped_fraction")
        lines.append(
            f"| {r.shape} | {r.variant}{'' if r.status == 'ok' else ' (' + r.status + ')'} | {r.step_ms:.0f} | "
            f"{r.tokens_per_s:,.0f} | {ratio:.3f}x | {r.peak_gib:.2f} | {r.second_buffer_gib:.3f} | "
            f"{'' if hidden is None else f'{hidden:.0%}'} | {r.syncs_per_step} | {r.grad_max_rel_diff:.1e} | "
            f"{r.grads_bitwise} |"
        )
    lines += [
        "",
        (
            "vs sync: tokens/s over offload sync. H2D hidden: share of the reload copies' time during which the "
            "main stream was computing (one profiled step). grad max rel diff: LoRA gradients on one fixed batch "
            "against a first plain-checkpointing run; the checkpoint row is a rerun of it (the kernels' own noise)."
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES)
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--trace-dir",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="where the chrome trace and overlap summaries go (default: $OUT; none: no profile)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.offload needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for name in args.shapes:
        shape = SHAPES[name]
        est = estimate(shape.config(), TOKENS_PER_STEP, torch.bfloat16)
        print(
            f"# {shape.name}: layer inputs {est.checkpointed / 2**30:.2f} GiB with plain checkpointing, "
            f"{est.offloaded / 2**30:.2f} GiB pinned with offload, second buffer {est.second_buffer / 2**30:.3f} GiB",
            file=sys.stderr,
        )
        results += run_shape(shape, args, device, args.trace_dir)
    table = markdown(results, torch.cuda.get_device_name(device))
    print(table)
    payload = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "results": [asdict(r) for r in results],
    }
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2))
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        (args.trace_dir / "offload_bench.md").write_text(table + "\n")
        (args.trace_dir / "offload_bench.json").write_text(
            json.dumps(payload, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
