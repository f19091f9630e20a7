"""One LoRA training step, stock transformers + peft vs ftq, on the standard workload.

Run on a GPU: ``python -m bench.train_step [--shapes llama-8b qwen3-0.6b] [--json PATH]``.

Variants, all in one process on the same model object (bench/workload.py builds it):
- ``stock padded``: one sample per row, right-padded, ``attention_mask``, sdpa, HF's loss, in
  micro-batches of at most 16,384 padded tokens with gradient accumulation;
- ``stock packed``: one [1, 16384] row with restarting ``position_ids`` (transformers builds a
  dense block-diagonal mask per forward), sdpa, HF's loss (full logits);
- ``ftq``: the plan ``python -m trainer run`` makes for this job on this machine
  (``bench.plans``: ``trainer.plan.planner.plan``, installed by ``trainer.training.install.install``), with
  plain checkpointing: ``ftq_packed`` attention on the kernel the plan chooses (on CUDA torch's
  varlen_attn where it runs the model, else the Triton varlen kernel; printed per shape) with the
  metadata built once per batch, the fused loss (chunked linear + cross-entropy), the fused LoRA
  kernel (LoRA in bf16 with the update fused into the base matmul; adapters stay fp32 master
  weights) and the Triton RMSNorm, SwiGLU and RoPE kernels;
- ``ftq + offload``: ftq with ``offload_activations`` and ``double_buffered_reload`` on (layer
  inputs offloaded to pinned host memory, reloaded double-buffered): the memory-lean configuration;
- ``ftq, metadata cache off``: ftq with ``packed_metadata_cache`` off (the metadata rebuilt in
  every layer: the "before" of the caching optimization, all else equal);
- ``ftq, peft LoRA``: ftq with the ``lora_kernel`` decision off: peft's own LoRA forward (fp32
  adapters: every adapted layer's input cast to fp32 and back) — the gain of the fused LoRA kernel;
- ``ftq, unfused norm/SwiGLU``: ftq with the ``fused_ops`` decision off: transformers' own
  RMSNorm, MLP and RoPE — the gain of ``trainer.features.fused_ops.patch``.
Each ftq variant is installed, timed and removed (``Installation.remove()``) on the same model;
its result records the installed pieces and the decisions that differ from the all-``auto`` plan.
Per variant: ``--warmup`` steps, then ``--steps`` timed steps with CUDA events around forward
(model + loss), backward and the optimizer step; tokens/s counts real tokens; peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps; host syncs are counted in one extra
step under ``torch.cuda.set_sync_debug_mode("warn")``. MFU is the trainer's: ``trainer.training.flops``'s
model FLOPs of the built model (frozen matmul weights 4 per parameter per token, LoRA's A and B 6,
in-sample causal attention 3.5 x its forward; recompute not counted) over the step time and the
trainer's peak (``trainer.plan.hardware.detect``: the bf16 matmul rate measured once per GPU and cached,
else the datasheet value; printed with its source). ``--profile`` adds a torch.profiler summary of one ftq
step (top GPU kernels, GPU busy time vs step time, kernel launches).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.plans import Planner, attention_line, ftq_loss
from bench.workload import (
    SHAPES,
    TOKENS_PER_STEP,
    ModelShape,
    build_lora_model,
    packed_batch,
    packed_steps,
    padded_batch,
)
from trainer.training.flops import FlopCounter
from trainer.training.install import Installation, install

VARIANTS = ("stock padded", "stock packed", "ftq", "ftq + offload", "ftq, metadata cache off", "ftq, peft LoRA",
            "ftq, unfused norm/SwiGLU")


@dataclass
class Result:
    shape: str
    variant: str
    status: str = "ok"
    step_ms: float = float("nan")
    forward_ms: float = float("nan")
    backward_ms: float = float("nan")
    optimizer_ms: float = float("nan")
    tokens_per_s: float = float("nan")
    peak_gib: float = float("nan")
    mfu: float = float("nan")
    syncs_per_step: int = -1
    sync_sites: list[str] = field(default_factory=list)
    """Where the counted host syncs come from (file:line of the Python call that synchronized)."""
    losses: list[float] = field(default_factory=list)
    installed: list[str] = field(default_factory=list)
    """The plan's installed pieces (``Installation.describe()``); empty for a stock variant."""
    plan: list[str] = field(default_factory=list)
    """The plan's decisions that differ from the all-``auto`` plan (``bench.plans.changes``)."""


def mfu_peak(device: torch.device) -> tuple[float, str]:
    """MFU's peak on ``device`` in TFLOP/s and its source: the trainer's (``Hardware.peak_flops`` /
    ``peak_source``), so the bench's MFU and the step events' divide by the same number."""
    from trainer.plan.hardware import detect

    hw = detect(device.type)
    return (hw.peak_flops / 1e12 if hw.peak_flops else math.nan), hw.peak_source or "no peak known"


def matmul_peak_tflops(device: torch.device) -> float:
    """``mfu_peak``'s TFLOP/s."""
    return mfu_peak(device)[0]


@dataclass(frozen=True)
class Recipe:
    """An ftq variant as a plan: its ``optimizations`` switches and the kernel choices it turns off."""

    switches: dict[str, str]
    off: tuple[str, ...] = ()


NO_OFFLOAD = {"offload_activations": "off"}
"""Every ftq variant but ``ftq + offload`` keeps plain checkpointing, whatever ``auto`` would say."""
RECIPES = {
    "ftq": Recipe(NO_OFFLOAD),
    "ftq + offload": Recipe({"offload_activations": "on", "double_buffered_reload": "on"}),
    "ftq, metadata cache off": Recipe({**NO_OFFLOAD, "packed_metadata_cache": "off"}),
    "ftq, peft LoRA": Recipe(NO_OFFLOAD, off=("lora_kernel",)),
    "ftq, unfused norm/SwiGLU": Recipe(NO_OFFLOAD, off=("fused_ops",)),
}


class Variant:
    """How one variant runs a step's forward + loss on ``model``: an ftq variant installs its plan
    (``bench.plans``), a stock variant runs transformers as built (sdpa, HF's loss)."""

    def __init__(self, name: str, model, shape: ModelShape, device: torch.device, planner: Planner | None = None):
        self.name, self.model, self.shape, self.device = name, model, shape, device
        self.installation: Installation | None = None
        self.installed: list[str] = []
        self.plan: list[str] = []
        """The decisions that differ from the all-``auto`` plan."""
        recipe = RECIPES.get(name)
        if recipe is None:
            return
        assert planner is not None, f"variant {name!r} is a plan: pass a Planner"
        chosen = planner.plan(recipe.off, **recipe.switches)
        self.installation = install(model, chosen)  # a failed install removes what it had applied
        self.installed = self.installation.describe()
        self.plan = planner.changes(chosen)

    def close(self) -> None:
        if self.installation is not None:
            self.installation.remove()
            self.installation = None

    def micro_batches(self, lengths: list[int], seed: int) -> list:
        """The step as closures, each returning one micro-batch's (loss, real tokens) to backpropagate.

        Packed variants: one micro-batch of 16,384 tokens. ``stock padded``: consecutive samples,
        one per row, as many rows as keep ``rows x longest`` within 16,384 tokens (gradient
        accumulation, as a padded HF Trainer run with a token budget does); each loss is HF's
        per-micro-batch mean, weighted by its share of the step's label tokens.
        """
        vocab = self.shape.vocab
        if self.name == "stock padded":
            groups, current = [], []
            for n in lengths:
                if current and (len(current) + 1) * max(*current, n) > TOKENS_PER_STEP:
                    groups.append(current)
                    current = []
                current.append(n)
            groups.append(current)
            total_labels = sum(n - 1 for n in lengths)

            def padded(group, k):
                batch = padded_batch(group, vocab, self.device, seed * 1000 + k)
                out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 labels=batch.labels)
                return out.loss * (sum(n - 1 for n in group) / total_labels), batch.real_tokens

            return [lambda g=g, k=k: padded(g, k) for k, g in enumerate(groups)]

        def packed():
            batch = packed_batch(lengths, vocab, self.device, seed)
            if self.installation is None:
                out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
                return out.loss, sum(lengths)
            return ftq_loss(self.installation, self.model, batch, self.device), sum(lengths)

        return [packed]


def run_variant(variant: Variant, optimizer, steps: list[list[int]], warmup: int, peak_tflops: float,
                shape: ModelShape, keep_gc: bool = False) -> Result:
    result = Result(shape.name, variant.name)

    def step(i: int, events=None):
        """One optimizer step; ``events`` collects (start, forward done, backward done) per micro-batch."""
        loss_sum, tokens = 0.0, 0
        for micro_batch in variant.micro_batches(steps[i], seed=i):
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if events is not None else None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if marks:
                    marks[0].record()
                loss, n = micro_batch()
                if marks:
                    marks[1].record()
            loss.backward()
            if marks:
                marks[2].record()
                events["micro"].append(marks)
            loss_sum, tokens = loss_sum + loss.detach(), tokens + n
        if events is not None:
            events["opt"].append([torch.cuda.Event(enable_timing=True) for _ in range(2)])
            events["opt"][-1][0].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if events is not None:
            events["opt"][-1][1].record()
        return loss_sum, tokens

    if not keep_gc:  # a gen-2 collection over the model's Python objects stalls a host-bound step
        gc.collect()
        gc.disable()
    try:
        return _timed(variant, step, steps, warmup, peak_tflops, result)
    finally:
        gc.enable()


def _timed(variant: Variant, step, steps: list[list[int]], warmup: int, peak_tflops: float, result: Result) -> Result:
    device = variant.device
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    # Host syncs: one untimed step under the sync debugger.
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):  # the Python stack that led to it, innermost last
            frames = traceback.extract_stack()[:-1]
            sites.append(" <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[::-1][:8]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(warmup)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    result.syncs_per_step = len(sites)
    result.sync_sites = sorted(set(sites))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    timed = range(warmup + 1, len(steps))
    events = {"micro": [], "opt": []}
    losses, tokens = [], 0
    wall = time.perf_counter()
    for i in timed:
        loss, n = step(i, events)
        losses.append(loss)
        tokens += n
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    n = len(timed)
    result.forward_ms = sum(m[0].elapsed_time(m[1]) for m in events["micro"]) / n
    result.backward_ms = sum(m[1].elapsed_time(m[2]) for m in events["micro"]) / n
    result.optimizer_ms = sum(o[0].elapsed_time(o[1]) for o in events["opt"]) / n
    result.step_ms = wall * 1e3 / n
    result.tokens_per_s = tokens / wall
    result.peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    counter = FlopCounter.for_model(variant.model)
    result.mfu = sum(counter.step_flops(steps[i]) for i in timed) / wall / (peak_tflops * 1e12)
    result.losses = [float(x) for x in losses]
    return result


def run_variant_cpu(variant: Variant, optimizer, steps: list[list[int]], warmup: int, shape: ModelShape) -> Result:
    """``run_variant``'s steps on the CPU, timed by wall clock (no syncs, memory or MFU): smoke runs."""
    result = Result(shape.name, variant.name)
    timed = range(warmup + 1, len(steps))
    fwd = bwd = opt = wall = 0.0
    tokens = 0
    for i in range(len(steps)):
        step_start, loss_sum = time.perf_counter(), 0.0
        for micro_batch in variant.micro_batches(steps[i], seed=i):
            t0 = time.perf_counter()
            loss, n = micro_batch()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if i in timed:
                fwd, bwd, tokens = fwd + t1 - t0, bwd + t2 - t1, tokens + n
            loss_sum += float(loss.detach())
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i in timed:
            t4 = time.perf_counter()
            opt, wall = opt + t4 - t3, wall + t4 - step_start
            result.losses.append(loss_sum)
    n = len(timed)
    result.step_ms, result.optimizer_ms = wall * 1e3 / n, opt * 1e3 / n
    result.forward_ms, result.backward_ms = fwd * 1e3 / n, bwd * 1e3 / n
    result.tokens_per_s = tokens / wall
    return result


def profile_step(variant: Variant, optimizer, lengths: list[int], out_path: str | None) -> str:
    """One ftq step under torch.profiler: where the GPU time goes, and how busy the GPU is."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = time.perf_counter()
        for micro_batch in variant.micro_batches(lengths, seed=10_000):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = micro_batch()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - wall
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    gpu_us = sum(e.device_time_total for e in events)
    launches = sum(e.count for e in events)
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    lines = [f"profiled step wall {wall * 1e3:.1f} ms (profiler on), GPU kernel time {gpu_us / 1e3:.1f} ms, "
             f"{launches} kernel launches", "", "| kernel | calls | GPU ms | share |", "|---|---:|---:|---:|"]
    for e in events[:20]:
        lines.append(f"| {e.key[:90]} | {e.count} | {e.device_time_total / 1e3:.1f} | "
                     f"{e.device_time_total / gpu_us:.1%} |")
    text = "\n".join(lines)
    if out_path:
        with open(out_path, "w") as fh:
            fh.write(text + "\n\n" + prof.key_averages().table(sort_by="device_time_total", row_limit=60))
    return text


def bench_shape(shape: ModelShape, variants: list[str], device: torch.device, warmup: int, timed: int,
                peak: float, profile_out: str | None, keep_gc: bool = False) -> tuple[list[Result], str]:
    model, optimizer = build_lora_model(shape, device)
    try:
        return run_variants(model, optimizer, shape, variants, device, warmup, timed, peak, profile_out, keep_gc)
    finally:
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()


def run_variants(model, optimizer, shape: ModelShape, variants: list[str], device: torch.device, warmup: int,
                 timed: int, peak: float, profile_out: str | None = None, keep_gc: bool = False,
                 method: str = "lora") -> tuple[list[Result], str]:
    """Each variant in turn on ``model`` (installed, timed, undone); one failing variant does not stop the rest.

    ``method`` is the job's (``lora``, or ``qlora`` for ``bench.qlora``'s 4-bit base): the plans are made for it.
    """
    model.train()
    steps = packed_steps(warmup + 1 + timed)
    planner = Planner.for_model(model, shape, device, method=method)
    print(f"  {shape.name}: {attention_line(planner.default)}", flush=True)
    results, profile_text = [], ""
    for name in variants:
        variant = None
        try:
            variant = Variant(name, model, shape, device, planner)
            if variant.installation is not None:
                variant.installation.watch(optimizer)  # as the trainer does
            if variant.installed:
                print(f"  {shape.name} / {name}: installed {'; '.join(variant.installed)}", flush=True)
                print(f"  {shape.name} / {name}: plan {'; '.join(variant.plan) or 'as auto'}", flush=True)
            results.append(run_variant(variant, optimizer, steps, warmup, peak, shape, keep_gc=keep_gc))
            results[-1].installed, results[-1].plan = variant.installed, variant.plan
            if profile_out and name == "ftq":
                profile_text = profile_step(variant, optimizer, steps[0], profile_out)
        except torch.OutOfMemoryError as exc:
            results.append(Result(shape.name, name, status=f"OOM ({str(exc).splitlines()[0][:80]})"))
        except Exception as exc:  # report and go on: one broken variant must not hide the others
            results.append(Result(shape.name, name, status=f"error: {type(exc).__name__}: {str(exc)[:200]}"))
        finally:
            if variant is not None:
                variant.close()
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        r = results[-1]
        print(f"  {shape.name} / {name}: {r.status}, {r.tokens_per_s:,.0f} tok/s, {r.peak_gib:.1f} GiB, "
              f"syncs {r.syncs_per_step} {r.sync_sites or ''}", flush=True)
    return results, profile_text


def table(results: list[Result]) -> str:
    lines = ["| shape | variant | tokens/s | step ms | fwd ms | bwd ms | optim ms | peak GiB | MFU | host syncs/step "
             "| vs stock packed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.status != "ok":
            lines.append(f"| {r.shape} | {r.variant} | {r.status} | | | | | | | | |")
            continue
        base = next((b for b in results if b.shape == r.shape and b.variant == "stock packed" and b.status == "ok"),
                    None)
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "n/a"
        lines.append(f"| {r.shape} | {r.variant} | {r.tokens_per_s:,.0f} | {r.step_ms:.0f} | {r.forward_ms:.0f} | "
                     f"{r.backward_ms:.0f} | {r.optimizer_ms:.1f} | {r.peak_gib:.2f} | {r.mfu:.1%} | "
                     f"{r.syncs_per_step} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write all numbers to this JSON file")
    parser.add_argument("--keep-gc", action="store_true",
                        help="leave Python's garbage collector on while timing (default: collected, then off)")
    parser.add_argument("--profile", help="write a profiler table of one ftq step per shape to PATH.<shape>.txt")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.train_step needs a CUDA device", file=sys.stderr)
        return 2
    from bench.attention import device_line

    device = torch.device("cuda")
    peak, peak_source = mfu_peak(device)
    print(f"device: {device_line()}\nMFU peak: {peak:.0f} TFLOP/s bf16 ({peak_source})", flush=True)
    results, profiles = [], {}
    for key in args.shapes:
        shape = SHAPES[key]
        out = f"{args.profile}.{key}.txt" if args.profile else None
        rs, prof = bench_shape(shape, args.variants, device, args.warmup, args.steps, peak, out, args.keep_gc)
        results += rs
        profiles[shape.name] = prof
    print()
    print(table(results))
    for name, text in profiles.items():
        if text:
            print(f"\n### profile: {name}, one ftq step\n{text}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=device_line(), matmul_peak_tflops=peak, peak_source=peak_source,
                           results=[r.__dict__ for r in results], profiles=profiles), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
