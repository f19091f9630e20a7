"""The product path: a job.json through ``python -m trainer run`` (or torchrun), timed by its own events.

What a user runs, on the standard workload: a random-weight model of a shape from
``bench/workload.py`` saved to disk with ``save_pretrained`` (bf16 safetensors, the locally
trained tiny tokenizer beside it: the vocabulary size only changes which embedding rows are read),
a text JSONL whose samples have the standard lognormal lengths (median 250, sigma 1, clipped to
[16, 4096]; each sample is ``<bos> w w ... <eos>`` of single-token words, so its token count is
exact), LoRA r=16 alpha=16 on every linear projection, ``batch_tokens`` 16,384, every switch on
``auto``. The trainer packs greedily (no cut samples), so a step holds up to 16,384 real tokens.

Run on a GPU::

    python -m bench.product_path --shapes llama-8b [--steps 12] [--skip 3] [--json PATH]
                                 [--set optimizations.offload_activations=on] [--nproc 2]

Per run: tokens/s is the sum of real tokens over the sum of step times of the steps after
``--skip`` warm-up steps, read from the trainer's ``step`` events (CUDA-event timings, read a step
late); peak memory is the largest ``gpu_mem_peak``; MFU is the trainer's. ``--set`` changes a
job field (dotted path, JSON value); ``--nproc N`` launches ``torchrun --standalone
--nproc_per_node=N`` with ``gpus: N``. ``--device cpu --tiny`` runs the same machinery on a tiny
Llama on the CPU (the unit test's smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.workload import GPT_OSS_20B, LORA_TARGETS, SHAPES, TOKENS_PER_STEP, ModelShape, lognormal_lengths

PRODUCT_SHAPES = {**SHAPES, "gpt-oss-20b": GPT_OSS_20B}
"""The dense shapes, and GPT-OSS-20B (LoRA on ``all-linear``: attention and the 3-D expert weights)."""

TINY = ModelShape("tiny-Llama", "llama", 64, 2, 4, 2, 16, 128, 512)


@dataclass
class ProductResult:
    shape: str
    label: str
    status: str = "ok"
    tokens_per_s: float = float("nan")
    step_ms_median: float = float("nan")
    peak_gib: float = float("nan")
    mfu: float | None = None
    steps_timed: int = 0
    plan: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    """Every step's time (the warm-up ones too), so an outlier is visible next to the median."""
    tokens: list[int] = field(default_factory=list)
    seconds: float = float("nan")
    step_ms_p99: float = float("nan")
    wall_tokens_per_s: float = float("nan")
    """Tokens over the wall time between the step events after warm-up: what a user gets, every
    gap between steps (data, events, a stall outside the timed step) included."""
    alloc_retries: int | None = None
    """The CUDA caching allocator's retries over the timed steps (``gpu_alloc_retries``)."""


def save_model(shape: ModelShape, directory: Path, device: str) -> Path:
    """A random-weight ``shape`` model in bf16 (fp32 on the CPU) and the tiny tokenizer, saved."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.model.tiny import build_tokenizer

    if (directory / "config.json").exists():
        return directory
    config = shape.config()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(512).save_pretrained(directory)
    del model
    if device == "cuda":  # else this process keeps the weights' memory cached while the trainer runs
        torch.cuda.empty_cache()
    return directory


def write_dataset(path: Path, model_dir: Path, count: int, seed: int = 0) -> list[int]:
    """``count`` text samples with the standard lengths (exact token counts); returns the lengths."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = _single_token_words(tokenizer)
    lengths = lognormal_lengths(count, seed=seed)
    with path.open("w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            body = "".join(words[(i * 7 + k) % len(words)] for k in range(n - 2))  # + bos + eos
            f.write(json.dumps({"text": body}) + "\n")
    return lengths


def _single_token_words(tokenizer: Any) -> list[str]:
    """Words (with their leading space) that the tokenizer encodes as one token, in any sequence."""
    found = []
    for token in sorted(tokenizer.get_vocab()):
        word = tokenizer.convert_tokens_to_string([token])
        if word.startswith(" ") and word[1:].isalpha() and len(tokenizer(word * 3, add_special_tokens=False)["input_ids"]) == 3:
            found.append(word)
    if len(found) < 8:
        raise RuntimeError(f"the tokenizer has only {len(found)} single-token words; the dataset needs 8")
    return found


def job_for(model_dir: Path, data: Path, out: Path, steps: int, device: str, gpus: int, tokens: int) -> dict[str, Any]:
    return {
        "model": {"name_or_path": str(model_dir)},
        "data": {"train_path": str(data), "format": "text", "max_seq_len": min(4096, tokens), "batch_tokens": tokens},
        "optim": {"max_steps": steps, "learning_rate": 1e-4, "warmup_steps": 1},
        "lora": {"r": 16, "alpha": 16, "target_modules": list(LORA_TARGETS)},  # MoE: bench_shape sets all-linear
        "output_dir": str(out),
        "checkpoint_every": 0,
        "resume": False,
        "device": device,
        "gpus": gpus,
    }


def set_field(job: dict[str, Any], assignment: str) -> None:
    """``a.b=value`` (value as JSON, else a string) into ``job``."""
    path, _, raw = assignment.partition("=")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    *parents, leaf = path.split(".")
    node = job
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def run_job(job_path: Path, nproc: int, timeout_s: float) -> tuple[list[dict[str, Any]], str]:
    """The trainer's events and the tail of its stderr."""
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        argv = [sys.executable]
    argv += ["-m", "trainer", "run", str(job_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return events, done.stderr[-3000:]


def summarize(shape: str, label: str, events: list[dict[str, Any]], skip: int) -> ProductResult:
    result = ProductResult(shape, label)
    steps = [e for e in events if e["type"] == "step"]
    done = next((e for e in events if e["type"] == "done"), None)
    plan = next((e for e in events if e["type"] == "plan"), {})
    result.plan = [d for d in plan.get("decisions", [])]
    result.losses = [e["loss"] for e in steps]
    result.step_ms = [e["step_ms"] for e in steps]
    result.tokens = [e["tokens"] for e in steps]
    if done is None or done["status"] != "succeeded":
        result.status = f"failed: {done and done.get('message')}"
        return result
    timed = steps[skip:] or steps
    seconds = sum(e["step_ms"] for e in timed) / 1000.0
    result.tokens_per_s = sum(e["tokens"] for e in timed) / seconds
    result.step_ms_median = statistics.median(e["step_ms"] for e in timed)
    peaks = [e["gpu_mem_peak"] for e in timed if e.get("gpu_mem_peak") is not None]
    result.peak_gib = max(peaks) / 2**30 if peaks else float("nan")
    mfus = [e["mfu"] for e in timed if e.get("mfu") is not None]
    result.mfu = statistics.median(mfus) if mfus else None
    result.steps_timed = len(timed)
    result.step_ms_p99 = _percentile([e["step_ms"] for e in timed], 0.99)
    result.wall_tokens_per_s = _wall_rate(steps, skip)
    retries = [e["gpu_alloc_retries"] for e in timed if e.get("gpu_alloc_retries") is not None]
    result.alloc_retries = sum(retries) if retries else None
    return result


def _percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..1): with under 100 steps, p99 is the slowest."""
    ordered = sorted(values)
    import math

    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _wall_rate(steps: list[dict[str, Any]], skip: int) -> float:
    """Tokens of the steps after the ``skip``-th over the wall time from its event to the
    last-but-one's. An event is emitted when its step's end is read, one step late (after the
    next step is queued), so consecutive events are a step apart; the last one is read at once
    after the one before and is left out."""
    if len(steps) <= skip + 2 or any("time" not in e for e in steps):
        return float("nan")
    start, timed = steps[skip], steps[skip + 1:-1]
    seconds = timed[-1]["time"] - start["time"]  # the trainer stamps events with time.time()
    return sum(e["tokens"] for e in timed) / seconds if seconds > 0 else float("nan")


def table(results: list[ProductResult]) -> str:
    lines = [
        "| shape | run | tokens/s | wall tokens/s | median step ms | p99 step ms | peak GiB | MFU | alloc retries "
        "| steps timed | attention | parallelism |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        decisions = {d["name"]: d for d in r.plan}
        attention = (decisions.get("attention") or {}).get("backend") or "-"
        parallel = (decisions.get("parallelism") or {}).get("backend") or "-"
        if r.status != "ok":
            lines.append(f"| {r.shape} | {r.label} | {r.status} | | | | | | | | {attention} | {parallel} |")
            continue
        mfu = f"{r.mfu:.1%}" if r.mfu is not None else "-"
        retries = "-" if r.alloc_retries is None else str(r.alloc_retries)
        lines.append(
            f"| {r.shape} | {r.label} | {r.tokens_per_s:,.0f} | {r.wall_tokens_per_s:,.0f} | {r.step_ms_median:.0f} | "
            f"{r.step_ms_p99:.0f} | {r.peak_gib:.2f} | {mfu} | {retries} | {r.steps_timed} | {attention} | {parallel} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["llama-8b"], choices=list(PRODUCT_SHAPES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the figures")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="change a job field")
    parser.add_argument("--label", default="auto", help="the run's name in the table")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="LABEL:FIELD=VALUE[,FIELD=VALUE]",
        help="a further run per shape with these job fields changed (after --set); repeatable",
    )
    parser.add_argument(
        "--compare", action="store_true",
        help="also run bench.train_step's 'ftq' and 'stock packed' rows in this call (CUDA only)",
    )
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--keep-output", action="store_true", help="keep each run's output dir (checkpoints, export)")
    parser.add_argument("--workdir", default="/tmp/ftq-product-path")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (CPU smoke run)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    shapes = [(None, TINY)] if args.tiny else [(s, PRODUCT_SHAPES[s]) for s in args.shapes]
    tokens = 512 if args.tiny else TOKENS_PER_STEP
    runs = [(args.label, list(args.set))] + [parse_variant(v, args.set) for v in args.variant]
    results: list[ProductResult] = []
    for key, shape in shapes:
        for label, sets in runs:
            results.append(bench_shape(shape, args, tokens, label, sets))
            print(table(results[-1:]), flush=True)
        if args.compare and key in SHAPES:  # bench.train_step has the dense shapes
            results += component_rows(key, shape, args.steps - args.skip, args.skip)
    print("\n" + table(results))
    if len(results) > 1:
        print("\n" + ratios(results, args.label))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.status == "ok" for r in results) else 1


def parse_variant(spec: str, common: list[str]) -> tuple[str, list[str]]:
    """``LABEL:a.b=1,c=off`` -> (LABEL, common + [a.b=1, c=off])."""
    label, _, fields = spec.partition(":")
    if not label or not fields:
        raise SystemExit(f"--variant {spec!r}: expected LABEL:FIELD=VALUE[,FIELD=VALUE]")
    return label, list(common) + [f for f in fields.split(",") if f]


def component_rows(key: str, shape: ModelShape, timed: int, warmup: int) -> list[ProductResult]:
    """``bench.train_step``'s ftq and stock rows for ``key``, run now in a child process."""
    handle, name = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    out = Path(name)
    argv = [sys.executable, "-m", "bench.train_step", "--shapes", key, "--variants", "ftq", "stock packed",
            "--steps", str(max(timed, 3)), "--warmup", str(warmup), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0 or not out.read_text().strip():
        return [ProductResult(shape.name, "bench.train_step", status=f"failed: {done.stderr[-300:]}")]
    rows = []
    for r in json.loads(out.read_text())["results"]:
        row = ProductResult(shape.name, f"bench.train_step: {r['variant']}", status=r["status"])
        row.tokens_per_s, row.step_ms_median, row.peak_gib = r["tokens_per_s"], r["step_ms"], r["peak_gib"]
        row.mfu, row.steps_timed = r["mfu"], max(timed, 3)
        rows.append(row)
    return rows


def ratios(results: list[ProductResult], base_label: str) -> str:
    """Each row's tokens/s over its shape's ``base_label`` row (the product path, as configured)."""
    lines = [f"| shape | run | tokens/s | vs {base_label} |", "|---|---|---:|---:|"]
    base = {r.shape: r.tokens_per_s for r in results if r.label == base_label and r.status == "ok"}
    for r in results:
        if r.status != "ok" or r.shape not in base:
            continue
        lines.append(f"| {r.shape} | {r.label} | {r.tokens_per_s:,.0f} | {r.tokens_per_s / base[r.shape]:.3f}x |")
    return "\n".join(lines)


def bench_shape(shape: ModelShape, args: argparse.Namespace, tokens: int, label: str, sets: list[str]) -> ProductResult:
    started = time.perf_counter()
    root = Path(args.workdir) / shape.name
    root.mkdir(parents=True, exist_ok=True)
    model_dir = save_model(shape, root / "model", args.device)
    data = root / "train.jsonl"
    count = max(64, args.steps * args.nproc * tokens // 250 * 2)
    write_dataset(data, model_dir, count)
    job = job_for(model_dir, data, root / f"out-{label}", args.steps, args.device, args.nproc, tokens)
    if shape.experts:  # the experts are 3-D parameters, not nn.Linear: all-linear reaches them
        job["lora"]["target_modules"] = ["all-linear"]
    for assignment in sets:
        set_field(job, assignment)
    job_path = root / f"job-{label}.json"
    job_path.write_text(json.dumps(job, indent=2))
    events, stderr = run_job(job_path, args.nproc, args.timeout)
    result = summarize(shape.name, label, events, args.skip)
    result.seconds = time.perf_counter() - started
    if not getattr(args, "keep_output", False):  # a full fine-tuning run's last checkpoint of an 8B
        shutil.rmtree(root / f"out-{label}", ignore_errors=True)  # model is ~100 GB: the next run's disk
    if result.status != "ok":
        print(stderr, file=sys.stderr)
    return result


if __name__ == "__main__":
    sys.exit(main())
