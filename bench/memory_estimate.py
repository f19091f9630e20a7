"""Estimated vs measured peak GPU memory of each activation policy (issue 13, docs/benchmarks.md).

For each model of the standard workload (``bench.ablation.MODELS``: Qwen3-0.6B and
Llama-3.1-8B with LoRA, Qwen3-14B with QLoRA, GPT-OSS-20B with LoRA on attention and experts;
random weights, 16,384-token packed steps), built once, and each activation policy (``none``,
``selective`` with half the layers checkpointed, ``full``, ``full+offload``): the plan the
trainer would make for the job (``bench.plans``) with that policy installed through
``trainer.training.install`` (``trainer.features.checkpointing.policy.with_policy``), ``--warmup`` steps, then
one step measured by ``torch.cuda.max_memory_allocated`` (reset before it; the weights, the
optimizer state and everything the step allocates are in it). Beside it, ``trainer.plan.memory``'s
estimate for the same shape and job, and the ratio. A policy whose estimate exceeds the GPU's
free memory is skipped (``skipped``), one that runs out anyway is ``OOM``. Below the table, the
policy ``auto`` picks for each model on this GPU, with its reason.

Run on a GPU (one command, prints a markdown table; ``--json`` keeps the rows)::

    python -m bench.memory_estimate [--models qwen3-0.6b,llama-8b,qwen3-14b,gpt-oss-20b]
                                    [--policies none,selective,full,full+offload] [--warmup 1]

``--device cpu --tiny`` runs the same machinery on tiny models (measured: ``-``): the unit test's
smoke run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench.ablation import MODELS, TINY_MODELS, TINY_TOKENS, ModelSpec
from bench.plans import Planner, ftq_loss
from bench.workload import TOKENS_PER_STEP, packed_batch, packed_steps
from trainer.plan import memory
from trainer.features.checkpointing import policy as checkpointing
from trainer.training.install import install
from trainer.plan.types import Plan
from trainer.plan.planner import plan

POLICIES = ("none", "selective", "full", "full+offload")


@dataclass
class Row:
    model: str
    method: str
    policy: str
    estimated_gib: float
    measured_gib: float | None = None
    status: str = "ok"
    parts: str = ""
    """The estimate's components (weights, grads+optimizer, activations, workspace)."""

    @property
    def ratio(self) -> str:
        if self.measured_gib is None:
            return "-"
        return f"{self.estimated_gib / self.measured_gib:.3f}"


def workload(chosen: Plan, planner: Planner, tokens: int) -> memory.Workload:
    """The ``trainer.plan.memory`` workload of the bench job, as ``trainer.plan.planner.plan`` builds it."""
    config = planner.config
    return memory.Workload(
        tokens=tokens, max_seq_len=config.data.max_seq_len, method=config.method, dtype=chosen.dtype,
        lora_rank=config.lora.r, fused_loss=planner.facts.fused_loss is None,
        packed_attention=chosen.decision("attention").enabled,
    )


def policy_backend(policy: str, layers: int) -> str:
    return checkpointing.selective_backend(layers // 2, layers) if policy == "selective" else policy


def measure(model: Any, optimizer: Any, chosen: Plan, steps: list[list[int]], vocab: int,
            device: torch.device) -> float | None:
    """Run ``steps`` under ``chosen``; the last one's peak allocated GiB (None off CUDA)."""
    installed = install(model, chosen)
    try:
        for i, lengths in enumerate(steps):
            if device.type == "cuda" and i == len(steps) - 1:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            batch = packed_batch(lengths, vocab, device, seed=i)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = ftq_loss(installed, model, batch, device)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type != "cuda":
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) / memory.GIB
    finally:
        installed.remove()
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench_model(spec: ModelSpec, args: argparse.Namespace, device: torch.device) -> tuple[list[Row], str]:
    """Every policy of ``args.policies`` on one model; the rows and the line saying what ``auto`` picks."""
    shape = spec.load_shape()
    free_at_start = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    model, optimizer = spec.build(shape, device)
    model.train()
    planner = Planner.for_model(model, shape, device, method=spec.method, tokens=args.tokens)
    facts_shape = planner.facts.shape
    assert facts_shape is not None, f"{shape.name}: the config lacks a size the estimate needs"
    base = planner.default
    work = workload(base, planner, args.tokens)
    auto = plan(planner.hw, _auto(planner), planner.facts, free_gpu_bytes=free_at_start).decision(checkpointing.NAME)
    steps = packed_steps(args.warmup + 1, tokens_per_step=args.tokens)
    rows = []
    for policy in args.policies:
        backend = policy_backend(policy, facts_shape.layers)
        n = checkpointing.checkpointed_count(backend, facts_shape.layers)
        est = memory.estimate(facts_shape, work, policy, n if policy == "selective" else None)
        row = Row(shape.name, spec.method, backend, est.peak / memory.GIB, parts=est.describe())
        rows.append(row)
        if policy == "full+offload" and device.type == "cuda" and not planner.hw.pinned_memory:
            row.status = "skipped: no pinned memory"
        elif free_at_start is not None and est.peak > free_at_start:
            row.status = "skipped: est. > free"
        else:
            try:
                chosen = checkpointing.with_policy(base, backend, "bench.memory_estimate")
                row.measured_gib = measure(model, optimizer, chosen, steps, shape.vocab, device)
            except torch.OutOfMemoryError:
                row.status = "OOM"
        print(f"{row.model} {row.policy}: {row.status}, est. {row.estimated_gib:.2f} GiB, "
              f"measured {row.measured_gib if row.measured_gib is None else round(row.measured_gib, 2)}", flush=True)
    free = "-" if free_at_start is None else f"{free_at_start / memory.GIB:.1f} GiB free at start"
    line = f"- {shape.name}: auto picks `{auto.backend}` ({free}): {auto.reason}"
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, line


def _auto(planner: Planner) -> Any:
    import dataclasses

    return dataclasses.replace(planner.config, gradient_checkpointing="auto")


def table(rows: list[Row]) -> str:
    lines = [
        "| model | method | policy | estimated GiB | measured GiB | est./measured | estimate's parts |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = f"{r.measured_gib:.2f}" if r.measured_gib is not None else r.status if r.status != "ok" else "-"
        lines.append(f"| {r.model} | {r.method} | {r.policy} | {r.estimated_gib:.2f} | {measured} | {r.ratio} | {r.parts} |")
    return "\n".join(lines)


def device_line(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    total = torch.cuda.get_device_properties(device).total_memory / memory.GIB
    return f"{torch.cuda.get_device_name(device)} ({total:.1f} GiB), torch {torch.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.memory_estimate", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma-separated keys of bench.ablation.MODELS (default: all)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--warmup", type=int, default=1, help="steps before the measured one (the optimizer state)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny models (CPU smoke run)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    registry = TINY_MODELS if args.tiny else MODELS
    args.registry = registry
    args.models = args.models.split(",") if args.models else list(registry)
    args.policies = args.policies.split(",")
    unknown = [m for m in args.models if m not in registry] + [q for q in args.policies if q not in POLICIES]
    if unknown:
        p.error(f"unknown model or policy: {', '.join(unknown)} (models: {', '.join(registry)}; policies: {', '.join(POLICIES)})")
    args.tokens = TINY_TOKENS if args.tiny else TOKENS_PER_STEP
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.memory_estimate needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    print(f"device: {device_line(device)}; {args.tokens:,} tokens per step; margin the plan keeps: "
          f"{memory.MARGIN_FIXED / memory.GIB:.0f} GiB + {memory.MARGIN_SHARE:.0%}", flush=True)
    rows: list[Row] = []
    lines: list[str] = []
    for key in args.models:
        spec = args.registry[key]
        if spec.requires is not None and not _importable(spec.requires):
            lines.append(f"- {key}: skipped ({spec.requires} is not installed)")
            continue
        got, line = bench_model(spec, args, device)
        rows += got
        lines.append(line)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"device": device_line(device), "rows": [asdict(r) for r in rows], "auto": lines}, f, indent=2)
    print()
    print(table(rows))
    print()
    print("\n".join(lines))
    return 0


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    raise SystemExit(main())
