"""Where the sampler's time goes: prefill steps vs decode steps, and the GPU kernels of a decode step.

Run on a GPU: ``python -m bench.sampler_profile --shape llama-8b --batches 64 256``; a CPU smoke
run: ``python -m bench.sampler_profile --tiny --device cpu --batches 4``.

For each batch: the same model, LoRA and prompts as ``bench.sampler`` (random bf16 weights, LoRA
r16 unmerged, the trainer's kernels as ``trainer.generate.kernels`` installs them; ``--no-fused-ops``:
the fused LoRA layers only, as before session 17), the same warm-up, then one timed ``generate`` whose every step is
timed alone (a device sync after each, so the total is a little above an unsynced run's): the
steps that admit prompts (prefill) apart from the decode-only ones (graph replays with
``--cuda-graphs``). Then ``--profile-steps`` eager decode steps (no graph: their kernels are
visible to the profiler) at the same batch under ``torch.profiler``: GPU time per step by kernel
family, and the kernel count per step. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.product_path import TINY
from bench.sampler import build, ftq_generate, prompts
from bench.workload import SHAPES

FAMILIES = (
    ("attention (decode kernel)", r"decode|_attn|flash|sdpa|fmha"),
    ("gemm", r"gemm|gemv|cutlass|sm90|sm80|ampere|hopper|xmma|cublas|splitk|nvjet"),
    ("rmsnorm", r"rmsnorm|rms_norm"),
    ("swiglu / silu", r"swiglu|silu"),
    ("rope", r"rope|rotary"),
    ("cache write / index", r"index|scatter|gather|copy_|cat"),
    ("sampling / argmax / softmax", r"argmax|softmax|topk|sort|max|sample"),
    ("elementwise (mul/add/pow/mean/cast)", r"elementwise|vectorized|reduce|unrolled|fill"),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def timed_steps(engine: Any, ids: torch.Tensor, new: int) -> dict[str, Any]:
    """One generate with each step timed alone: the steps that admit prompts apart from decode-only ones."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda *a: None)
    inner = engine._step
    records: list[tuple[bool, float, int, bool]] = []

    def step(scheduler: Any, cache: Any) -> None:
        admits = bool(scheduler.queue)
        replays, before_tokens = engine.stats.graph_replays, engine.stats.forward_tokens
        sync()
        start = time.perf_counter()
        inner(scheduler, cache)
        sync()
        records.append((admits, time.perf_counter() - start, engine.stats.forward_tokens - before_tokens,
                        engine.stats.graph_replays > replays))

    engine._step = step
    try:
        _, total = ftq_generate(engine, ids, new)
    finally:
        del engine._step
    prefill = [r for r in records if r[0]]
    decode = [r for r in records if not r[0]]
    return {
        "seconds": total,
        "steps": len(records),
        "prefill_steps": len(prefill),
        "prefill_seconds": sum(r[1] for r in prefill),
        "prefill_tokens": sum(r[2] for r in prefill),
        "decode_steps": len(decode),
        "decode_seconds": sum(r[1] for r in decode),
        "decode_step_ms_median": 1000 * statistics.median([r[1] for r in decode]) if decode else None,
        "graph_steps": sum(r[3] for r in records),
    }


def profile_decode(engine: Any, ids: torch.Tensor, steps: int, prefill: bool = False) -> dict[str, Any]:
    """``steps`` eager decode steps of ``ids``' batch under torch.profiler: GPU µs per step by family.
    ``prefill``: the second step instead (prompts admitted beside the first step's sequences decoding)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.graphs = engine.graphs, None
    inner, seen = engine._step, {"n": 0}
    holder: dict[str, Any] = {}
    steps = 1 if prefill else steps

    def step(scheduler: Any, cache: Any) -> None:
        wanted = bool(scheduler.queue) if prefill else not scheduler.queue
        if wanted and "prof" not in holder and seen["n"] >= 1:
            cuda = [ProfilerActivity.CUDA] if engine.device.type == "cuda" else []
            holder["prof"] = profile(activities=[ProfilerActivity.CPU, *cuda])
            holder["prof"].__enter__()
            holder["start"] = seen["n"]
        inner(scheduler, cache)
        seen["n"] += 1
        if "prof" in holder and "done" not in holder and seen["n"] - holder["start"] >= steps:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            holder["prof"].__exit__(None, None, None)
            holder["done"] = True

    engine._step = step
    try:
        ftq_generate(engine, ids, steps + 4)
    finally:
        del engine._step
        engine.graphs = graphs
    prof = holder.get("prof")
    if prof is None or "done" not in holder:
        return {}
    return _kernel_table(prof, steps)


def _kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    """GPU µs per step by kernel family, kernels per step and the 25 largest, from ``prof``'s kernels."""
    by_family: dict[str, float] = defaultdict(float)
    kernels, top = 0, []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0 or getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue  # CPU ops carry their kernels' time too: count the kernels only
        by_family[family(event.key)] += device_us / steps
        kernels += event.count
        top.append((device_us / steps, event.count / steps, event.key[:90]))
    top.sort(reverse=True)
    return {"us_per_step": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "total_us_per_step": sum(by_family.values()), "kernels_per_step": kernels / steps,
            "top": top[:25]}


def replay_time_ms(graph: Any, replays: int) -> float:
    """A captured CUDA graph's ms per replay over ``replays`` back-to-back replays (CUDA events)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / replays


def graph_profile(engine: Any, ids: torch.Tensor, new: int, at: list[int], replays: int = 10) -> list[dict[str, Any]]:
    """At the decode steps ``at`` (counted after the last prompt is admitted) of one graphed
    generate: the whole step's wall time (synced before and after: host plan, replay, sampling,
    bookkeeping), then the step's graph replayed alone ``replays`` times back to back (its GPU time
    with launch gaps, CUDA events) and once more under torch.profiler (the sum of its kernels'
    times and their count). ``gap_ms`` = replay less kernels: the time between a graph's kernels;
    ``host_ms`` = step less replay: the host's work serial with the GPU. Replaying re-writes the
    same keys at the same positions, so the generate goes on unchanged."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.graphs
    if graphs is None or engine.device.type != "cuda":
        return []
    inner_step, inner_run = engine._step, graphs.run
    used: dict[str, Any] = {}
    seen = {"decode": 0}
    rows: list[dict[str, Any]] = []

    def run(model: Any, cache: Any, plan: Any, adapter: Any = None, ids: Any = None) -> Any:
        bucket = next(b for b in graphs.buckets if b >= len(plan.segments))
        used["key"] = (bucket, adapter)
        return inner_run(model, cache, plan, adapter, ids)

    def step(scheduler: Any, cache: Any) -> None:
        decoding = not scheduler.queue
        used.pop("key", None)
        torch.cuda.synchronize()
        start = time.perf_counter()
        inner_step(scheduler, cache)
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - start) * 1000
        if not decoding:
            return
        seen["decode"] += 1
        if seen["decode"] not in at or "key" not in used:
            return
        graph = graphs._graphs[used["key"]][0]
        replay_ms = replay_time_ms(graph, replays)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        table = _kernel_table(prof, 1)
        kernels_ms = table["total_us_per_step"] / 1000
        rows.append({"decode_step": seen["decode"], "bucket": used["key"][0], "step_ms": step_ms,
                     "replay_ms": replay_ms, "kernels_ms": kernels_ms, "gap_ms": replay_ms - kernels_ms,
                     "host_ms": step_ms - replay_ms, "kernels": table["kernels_per_step"],
                     "us_per_family": table["us_per_step"], "top": table["top"][:12]})

    engine._step, graphs.run = step, run
    try:
        ftq_generate(engine, ids, new)
    finally:
        del engine._step, graphs.run
    return rows


def host_profile(engine: Any, ids: torch.Tensor, new: int, sampled: bool) -> dict[str, Any]:
    """One generate under cProfile (the host's share: Python's own time per function), and the
    graphed forward's replay alone (its GPU time, no host work between replays)."""
    import cProfile
    import io
    import pstats

    from trainer.generate.params import Request, SamplingParams

    params = SamplingParams(max_tokens=new, temperature=1.0 if sampled else 0.0, ignore_eos=True, seed=7 if sampled else None)
    requests = [Request(tuple(row), params) for row in ids.tolist()]
    engine.generate(requests)
    profiler = cProfile.Profile()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    profiler.enable()
    engine.generate(requests)
    sync()
    profiler.disable()
    seconds = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    replay_ms = None
    graphs = engine.graphs
    if graphs is not None and graphs._graphs:
        graph = graphs._graphs[max(graphs._graphs, key=lambda k: k[0])][0]
        sync()
        start_replay = time.perf_counter()
        for _ in range(20):
            graph.replay()
        sync()
        replay_ms = (time.perf_counter() - start_replay) / 20 * 1000
    return {"seconds": seconds, "sampled": sampled, "replay_ms_largest_bucket": replay_ms, "stats": text.getvalue()}


def _print_kernels(title: str, prof: dict[str, Any]) -> None:
    if not prof:
        return
    print(f"  {title}: {prof['total_us_per_step']:.0f} us GPU, {prof['kernels_per_step']:.0f} kernels")
    for name, us in prof["us_per_step"].items():
        print(f"    {name:40s} {us:9.0f} us")
    for us, count, key in prof["top"]:
        print(f"      {us:8.0f} us {count:6.0f}x  {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b", choices=list(SHAPES))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--no-fused-ops", action="store_true",
                        help="only the fused LoRA layers (not the trainer's RMSNorm/SwiGLU/RoPE kernels)")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--profile-prefill", action="store_true",
                        help="also one eager step that admits prompts (the second of a call) under torch.profiler")
    parser.add_argument("--host-profile", action="store_true", help="cProfile one generate; time the largest graph's replay")
    parser.add_argument("--sampled", action="store_true", help="the host profile's requests sample (temperature 1, a seed)")
    parser.add_argument("--graph-profile", type=int, nargs="*", metavar="STEP",
                        help="with --cuda-graphs: at these decode steps, the step's wall time, its graph's "
                             "replay alone and its kernels' sum (default steps 8 128 240)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    from trainer.features.lora_kernel import fused as lora_fused
    from trainer.generate import kernels
    from trainer.generate.engine import Engine

    shape = TINY if args.tiny else SHAPES[args.shape]
    device = torch.device(args.device)
    model = build(shape, device)
    installed = [kernels.install(model) if not args.no_fused_ops else lora_fused.install(model)]
    print(installed[-1].describe(), flush=True)
    out: dict[str, Any] = {"shape": shape.name, "fused_ops": not args.no_fused_ops, "cuda_graphs": args.cuda_graphs, "rows": []}
    for batch in args.batches:
        engine = Engine(model, None, slots=batch, max_len=args.prompt_tokens + args.new_tokens + 1,
                        max_batch_tokens=args.max_batch_tokens, cuda_graphs=args.cuda_graphs,
                        overlap=False)  # steps are timed one by one (synced): none runs ahead
        ids = prompts(batch, args.prompt_tokens, shape.vocab)
        ftq_generate(engine, ids, min(args.new_tokens, 16) if args.cuda_graphs else 2)
        if args.cuda_graphs:
            ftq_generate(engine, ids, args.new_tokens)  # every bucket captured
        row = {"batch": batch, **timed_steps(engine, ids, args.new_tokens)}
        row["tokens_per_s_synced"] = batch * args.new_tokens / row["seconds"]
        row["profile"] = profile_decode(engine, ids, args.profile_steps) if args.profile_steps else {}
        if args.profile_prefill:
            row["prefill_profile"] = profile_decode(engine, ids, 1, prefill=True)
            _print_kernels("eager prefill step (prompts + decoding rows)", row["prefill_profile"])
        if args.graph_profile is not None and args.cuda_graphs:
            row["graphs"] = graph_profile(engine, ids, args.new_tokens, args.graph_profile or [8, 128, 240])
            for item in row["graphs"]:
                print(f"  graphed decode step {item['decode_step']} (bucket {item['bucket']}): step {item['step_ms']:.2f} ms"
                      f" = replay {item['replay_ms']:.2f} (kernels {item['kernels_ms']:.2f} in {item['kernels']:.0f},"
                      f" gaps {item['gap_ms']:.2f}) + host {item['host_ms']:.2f}", flush=True)
                for name, us in item["us_per_family"].items():
                    print(f"    {name:40s} {us:9.0f} us")
                for us, count, key in item["top"]:
                    print(f"      {us:8.0f} us {count:6.0f}x  {key}")
        if args.host_profile:
            row["host"] = host_profile(engine, ids, args.new_tokens, args.sampled)
            print(f"  host-profiled generate: {row['host']['seconds']:.3f} s; largest graph replay "
                  f"{row['host']['replay_ms_largest_bucket']} ms\n{row['host']['stats']}", flush=True)
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "host", "graphs")}), flush=True)
        _print_kernels("eager decode step", row["profile"])
        engine.release()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for item in reversed(installed):
        item.uninstall()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
