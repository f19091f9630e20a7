"""Scaling over GPUs on the product path: each shape on 1, 2, ... GPUs in one call, side by side.

Each run is ``bench.product_path``'s (a job.json through ``python -m trainer run``, or
``torchrun --standalone --nproc_per_node=N`` with ``gpus: N``; every switch ``auto``; 16,384
tokens per rank per micro-batch, so N ranks train N times the tokens per step). The speed-up is
the run's tokens/s over the same shape's 1-GPU run of this call. Run on a lent machine::

    python -m bench.scaling --shapes qwen3-0.6b llama-8b --gpus 1 2 [--method full] [--steps 30]
                            [--skip 5] [--json PATH] [--set FIELD=VALUE]

``--method full`` trains every weight (FSDP2 on several GPUs, fp32 master weights). Per row:
tokens/s (over the sum of step times), wall tokens/s (over the wall time between step events,
stalls between steps included), per-GPU tokens/s, the speed-up, peak GPU memory (the largest
rank's), MFU, the median and p99 step, and the allocator's retries.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from bench.product_path import PRODUCT_SHAPES, ProductResult, bench_shape
from bench.workload import TOKENS_PER_STEP


def run(args: argparse.Namespace) -> list[tuple[int, ProductResult]]:
    rows: list[tuple[int, ProductResult]] = []
    sets = list(args.set) + ([f"method={args.method}"] if args.method != "lora" else [])
    for key in args.shapes:
        shape = PRODUCT_SHAPES[key]
        for gpus in args.gpus:
            one = argparse.Namespace(**{**vars(args), "nproc": gpus, "tiny": False})
            label = f"{args.method} {gpus} GPU{'s' if gpus > 1 else ''}"
            result = bench_shape(shape, one, TOKENS_PER_STEP, label, sets)
            rows.append((gpus, result))
            print(table(rows[-1:]), flush=True)
    return rows


def table(rows: list[tuple[int, ProductResult]]) -> str:
    base = {r.shape: r.tokens_per_s for g, r in rows if g == 1 and r.status == "ok"}
    lines = [
        "| shape | run | tokens/s | wall tokens/s | per GPU | vs 1 GPU | peak GiB/GPU | MFU | p50 step ms "
        "| p99 step ms | p99/p50 | alloc retries | steps timed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for gpus, r in rows:
        if r.status != "ok":
            lines.append(f"| {r.shape} | {r.label} | {r.status[:200]} | | | | | | | | | | |")
            continue
        speedup = f"{r.tokens_per_s / base[r.shape]:.3f}x" if r.shape in base else "-"
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        retries = "-" if r.alloc_retries is None else str(r.alloc_retries)
        lines.append(
            f"| {r.shape} | {r.label} | {r.tokens_per_s:,.0f} | {r.wall_tokens_per_s:,.0f} | "
            f"{r.tokens_per_s / gpus:,.0f} | {speedup} | {r.peak_gib:.1f} | {mfu} | {r.step_ms_median:.0f} | "
            f"{r.step_ms_p99:.0f} | {r.step_ms_p99 / r.step_ms_median:.2f} | {retries} | {r.steps_timed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3-0.6b"], choices=list(PRODUCT_SHAPES))
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--method", default="lora", choices=("lora", "qlora", "full"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the figures")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change a job field")
    parser.add_argument("--workdir", default="/tmp/ftq-product-path")
    parser.add_argument("--keep-output", action="store_true", help="keep each run's output dir (checkpoints, export)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    rows = run(args)
    print("\n" + table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([{"gpus": g, **asdict(r)} for g, r in rows], indent=2))
    return 0 if all(r.status == "ok" for _, r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
