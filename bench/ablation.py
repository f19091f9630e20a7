"""The full ablation of ftq's three optimizations (issue 4, section 4): one command, one table.

Run on the lent GPU::

    python -m bench.ablation [--shapes qwen3-0.6b llama-8b qwen3-14b gpt-oss-20b] [--json PATH]
                             [--warmup 2 --steps 3] [--rows ...]

``--device cpu --tiny`` runs the same row machinery on a tiny Llama and a tiny GPT-OSS on the
CPU (the plan's SDPA packed backend, offload through its synchronous CPU twin): the unit tests'
smoke run.

Workload (``bench/workload.py``, as ``bench/train_step.py``): random-weight bf16 models built
on the device from config classes, LoRA r=16, lognormal samples packed into steps of 16,384
real tokens, AdamW on the adapters. Models: Qwen3-0.6B, Llama-3.1-8B, Qwen3-14B with QLoRA
(``bench/qlora.py``; skipped without bitsandbytes) and GPT-OSS-20B (LoRA on q,k,v,o and on the
expert weights through peft ``target_parameters``).

Rows, one after another on the same model object (each installs its pieces and undoes them):

- ``stock HF+peft``: one packed [1, 16384] row with restarting ``position_ids``, transformers'
  attention (sdpa; GPT-OSS has none, so ``flex_attention``, else eager in micro-batches of
  whole samples: a 16k packed eager forward needs a [64, 16k, 16k] fp32 score tensor) and HF's
  loss over full logits; MoE experts as transformers configures them. Not a plan: it sets
  transformers' attention implementation and puts the previous one back.
- ``all off`` / ``metadata cache only`` / ``double-buffered reload only`` / ``MoE routing only``
  (MoE models) / ``all on``: each a plan (``bench.plans``: ``trainer.plan.planner.plan`` for the
  bench job with the row's switches ``on``/``off``, installed by ``trainer.training.install.install``,
  removed after the row): ``ftq_packed`` attention on the kernel the plan chooses, the plan's
  loss, LoRA kernel and fused elementwise ops; the three switches vary:
  ``packed_metadata_cache`` (metadata built once per batch vs rebuilt in every layer from the
  device position ids), ``double_buffered_reload`` (offloaded checkpoints reloaded
  double-buffered vs synchronously; ``offload_activations`` is on in every ftq row of the 8B, 14B
  and 20B models and off for Qwen3-0.6B, whose double-buffer row is n/a) and
  ``moe_grouped_routing`` (``trainer.features.moe.routing`` vs transformers' eager per-expert loop). Each
  row records its installed pieces and the decisions that differ from the all-``auto`` plan.

Timing is ``bench.train_step.run_variant``: warm-up steps, one step under the sync debugger
(host syncs), then timed steps with CUDA events around forward, backward and optimizer; MFU is
the trainer's (``trainer.training.flops`` on the built model: MoE counts the top-k experts' weights, expert
LoRA gives them a weight gradient; against ``trainer.plan.hardware``'s peak, printed with its source). A
failing row prints ``failed: <error>`` and the others go on. The table, summary and JSON are
``bench.ablation_report``'s.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.ablation_report import (
    ALL_OFF,
    ALL_ON,
    ALL_ON_NO_OFFLOAD,
    CACHE_ONLY,
    DOUBLE_ONLY,
    MOE_ONLY,
    NO_OFFLOAD,
    ROWS,
    STOCK,
    RowResult,
    failure_status,
    report,
    report_from_json,
    write_json,
)
from bench.plans import Planner, attention_line, ftq_loss
from bench.train_step import Result as StepResult
from bench.train_step import mfu_peak, run_variant, run_variant_cpu
from bench.workload import (
    GPT_OSS_20B,
    LLAMA_3_1_8B,
    QWEN3_0_6B,
    TOKENS_PER_STEP,
    ModelShape,
    build_lora_model,
    packed_batch,
    packed_steps,
)
from trainer.features.attention.packed import unwrap_model
from trainer.training.install import Installation, install

EAGER_MICRO_TOKENS = 4096
"""Stock eager micro-batch: a [64, 4k, 4k] fp32 score tensor is 4 GiB (16k would be 64 GiB)."""


@dataclass(frozen=True)
class Switches:
    """The three switches of an ftq row, each ``on`` or ``off`` in its plan."""

    packed_metadata_cache: bool = False
    double_buffered_reload: bool = False
    moe_grouped_routing: bool = False

    def optimizations(self, offload: bool) -> dict[str, str]:
        """The row's ``TrainConfig.optimizations``; ``offload``: ``offload_activations`` on."""

        def on(flag: bool) -> str:
            return "on" if flag else "off"

        return {
            "packed_metadata_cache": on(self.packed_metadata_cache),
            "double_buffered_reload": on(offload and self.double_buffered_reload),
            "moe_grouped_routing": on(self.moe_grouped_routing),
            "offload_activations": on(offload),
        }


@dataclass(frozen=True)
class RowSpec:
    name: str
    switches: Switches | None
    """None: the stock row."""
    skip: str | None = None
    """Why the row is not run (printed in its place)."""
    offload: bool = True
    """Offload the activations if the model's ftq rows do (``ModelSpec.offload``)."""


@dataclass(frozen=True)
class StockAttention:
    """How the stock row runs attention: transformers' implementation and the micro-batch size."""

    implementation: str
    micro_tokens: int | None
    """None: the whole step as one packed row; else consecutive samples up to this many tokens."""
    note: str


SDPA_PACKED = StockAttention("sdpa", None, "stock: packed sdpa, dense block mask")
GPT_OSS_STOCK = (
    StockAttention(
        "flex_attention", None, "stock: packed flex_attention (compiled; transformers has no sdpa path with sinks)"
    ),
    StockAttention(
        "eager",
        EAGER_MICRO_TOKENS,
        f"stock: eager attention in micro-batches of whole samples <= {EAGER_MICRO_TOKENS} tokens with "
        "gradient accumulation (16k packed eager needs a [64, 16k, 16k] fp32 score tensor)",
    ),
)
"""Tried in order: the first that runs is the stock row (the failures are noted)."""


@dataclass(frozen=True)
class ModelSpec:
    key: str
    load_shape: Callable[[], ModelShape]
    build: Callable[[ModelShape, torch.device], tuple[Any, Any]]
    offload: bool
    """Activations offloaded in every ftq row (plain checkpointing otherwise)."""
    is_moe: bool
    method: str = "lora"
    requires: str | None = None
    """A module that must be importable, else every row prints ``skipped``."""
    stock: tuple[StockAttention, ...] = (SDPA_PACKED,)


def _qlora_shape() -> ModelShape:
    from bench.qlora import QWEN3_14B

    return QWEN3_14B


def _build_qlora(shape: ModelShape, device: torch.device) -> tuple[Any, Any]:
    from bench.qlora import build_qlora_model

    return build_qlora_model(shape, device)


MODELS = {
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", lambda: QWEN3_0_6B, build_lora_model, offload=False, is_moe=False),
    "llama-8b": ModelSpec("llama-8b", lambda: LLAMA_3_1_8B, build_lora_model, offload=True, is_moe=False),
    "qwen3-14b": ModelSpec(
        "qwen3-14b", _qlora_shape, _build_qlora, offload=True, is_moe=False, method="qlora", requires="bitsandbytes"
    ),
    "gpt-oss-20b": ModelSpec(
        "gpt-oss-20b", lambda: GPT_OSS_20B, build_lora_model, offload=True, is_moe=True, stock=GPT_OSS_STOCK
    ),
}
TINY_LLAMA = ModelShape("tiny-Llama", "llama", 64, 2, 4, 2, 16, 128, 512)
TINY_GPT_OSS = ModelShape("tiny-GPT-OSS", "gpt_oss", 64, 2, 4, 2, 16, 64, 512, 4, 2, sliding_window=8)
TINY_MODELS = {
    "tiny-llama": ModelSpec("tiny-llama", lambda: TINY_LLAMA, build_lora_model, offload=True, is_moe=False),
    "tiny-gpt-oss": ModelSpec(
        "tiny-gpt-oss", lambda: TINY_GPT_OSS, build_lora_model, offload=True, is_moe=True,
        stock=(StockAttention("eager", None, "stock: packed eager (CPU)"),),
    ),
}
TINY_TOKENS = 512


def rows_for(spec: ModelSpec) -> list[RowSpec]:
    """The ablation rows of one model: stock, all off, each switch alone, all on."""
    double_skip = None if spec.offload else NO_OFFLOAD
    rows = [
        RowSpec(STOCK, None),
        RowSpec(ALL_OFF, Switches()),
        RowSpec(CACHE_ONLY, Switches(packed_metadata_cache=True)),
        RowSpec(DOUBLE_ONLY, Switches(double_buffered_reload=True), skip=double_skip),
    ]
    if spec.is_moe:
        rows.append(RowSpec(MOE_ONLY, Switches(moe_grouped_routing=True)))
    rows.append(RowSpec(ALL_ON, Switches(True, spec.offload, spec.is_moe)))
    if spec.offload:
        on = Switches(True, False, spec.is_moe)
        rows.append(RowSpec(ALL_ON_NO_OFFLOAD, on, offload=False))
    return rows


def micro_groups(lengths: list[int], micro_tokens: int | None) -> list[list[int]]:
    """Consecutive whole samples, each group at most ``micro_tokens`` tokens (a longer sample alone)."""
    if micro_tokens is None:
        return [list(lengths)]
    groups: list[list[int]] = [[]]
    for n in lengths:
        if groups[-1] and sum(groups[-1]) + n > micro_tokens:
            groups.append([])
        groups[-1].append(n)
    return groups


@dataclass
class ModelRun:
    """What every row of one model shares: the built model, its optimizer, its plans, the steps."""

    spec: ModelSpec
    shape: ModelShape
    model: torch.nn.Module
    optimizer: Any
    device: torch.device
    planner: Planner
    steps: list[list[int]]
    warmup: int
    peak_tflops: float


class AblationRow:
    """One row on ``run.model``: ``install`` its plan (or the stock attention), ``micro_batches``
    per step, ``close`` undoes it. ``name``, ``device`` and ``micro_batches`` are what
    ``bench.train_step.run_variant`` times."""

    def __init__(self, spec: RowSpec, run: ModelRun, stock: StockAttention | None = None) -> None:
        self.name, self.spec, self.run, self.stock = spec.name, spec, run, stock
        self.model, self.device = run.model, run.device
        self.installation: Installation | None = None
        self.installed: list[str] = []
        self.plan: list[str] = []
        self.notes: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        if self.spec.switches is None:
            self._install_stock()
            return
        offload = self.run.spec.offload and self.spec.offload
        chosen = self.run.planner.plan(**self.spec.switches.optimizations(offload))
        self.installation = install(self.model, chosen)
        self.installed = self.installation.describe()
        self.plan = self.run.planner.changes(chosen)

    def close(self) -> None:
        if self.installation is not None:
            self.installation.remove()
            self.installation = None
        while self._undo:
            self._undo.pop()()

    def _install_stock(self) -> None:
        assert self.stock is not None, "the stock row needs a StockAttention"
        lm = unwrap_model(self.model)
        if self.run.spec.is_moe:
            experts = getattr(lm.config, "_experts_implementation", None)
            self.notes.append(f"stock experts: transformers' {experts}")
        previous = lm.config._attn_implementation
        if previous != self.stock.implementation:
            lm.set_attn_implementation(self.stock.implementation)
            self._undo.append(lambda: lm.set_attn_implementation(previous))
        self.notes.append(self.stock.note)

    @property
    def second_buffer_gib(self) -> float:
        """The double-buffered reload's second buffer (0 without offload)."""
        if self.installation is None:
            return 0.0
        return self.installation.offloader.extra_gpu_bytes / 2**30

    def micro_batches(self, lengths: list[int], seed: int) -> list[Callable[[], Any]]:
        """The step as closures, each returning (loss to backpropagate, real tokens)."""
        vocab = self.run.shape.vocab
        if self.installation is not None:
            installation = self.installation

            def packed() -> tuple[torch.Tensor, int]:
                batch = packed_batch(lengths, vocab, self.device, seed)
                return ftq_loss(installation, self.model, batch, self.device), sum(lengths)

            return [packed]
        assert self.stock is not None
        total_labels = sum(n - 1 for n in lengths)

        def stock(group: list[int], k: int) -> tuple[torch.Tensor, int]:
            batch = packed_batch(group, vocab, self.device, seed * 1000 + k)
            out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
            # HF's loss is the micro-batch mean: weight it by its share of the step's labels.
            return out.loss * (sum(n - 1 for n in group) / total_labels), sum(group)

        groups = micro_groups(lengths, self.stock.micro_tokens)
        return [lambda g=g, k=k: stock(g, k) for k, g in enumerate(groups)]


# -- running ----------------------------------------------------------------------------------


def time_row(row: AblationRow, run: ModelRun) -> StepResult:
    """``bench.train_step.run_variant`` on CUDA; on the CPU the same steps by wall clock."""
    if run.device.type == "cuda":
        return run_variant(row, run.optimizer, run.steps, run.warmup, run.peak_tflops, run.shape)
    return run_variant_cpu(row, run.optimizer, run.steps, run.warmup, run.shape)


def run_row(spec: RowSpec, run: ModelRun) -> RowResult:
    """One row; the stock row tries ``run.spec.stock`` in order until one runs."""
    attempts: tuple[StockAttention | None, ...] = run.spec.stock if spec.switches is None else (None,)
    failures: list[str] = []
    start = time.perf_counter()
    result = RowResult(run.shape.name, spec.name, status="failed: nothing ran")
    for stock in attempts:
        row = AblationRow(spec, run, stock)
        try:
            row.install()
            step = time_row(row, run)
            result = RowResult.from_step(run.shape.name, spec.name, step)
            result.second_buffer_gib = row.second_buffer_gib
        except Exception as exc:  # noqa: BLE001 - one broken row must not hide the others
            result = RowResult(run.shape.name, spec.name, status=failure_status(exc))
            if stock is not None:
                failures.append(f"{stock.implementation}: {result.status}")
        finally:
            row.close()
            run.optimizer.zero_grad(set_to_none=True)
            run.optimizer.state.clear()  # fresh AdamW state per row
            gc.collect()
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
        result.installed, result.plan, result.notes = row.installed, row.plan, row.notes + failures
        if result.ok:
            break
    result.seconds = time.perf_counter() - start
    return result


def plan_note(planner: Planner) -> str:
    """What the plan decides on ``auto`` for offload and its reload here (the rows force them)."""
    parts = []
    for name in ("offload_activations", "double_buffered_reload"):
        d = planner.default.decision(name)
        parts.append(f"{name} {'on' if d.enabled else 'off'} ({d.reason})")
    return "plan on auto here: " + "; ".join(parts)


def build(
    spec: ModelSpec, shape: ModelShape, args: argparse.Namespace, device: torch.device, peak: float
) -> ModelRun:
    """Build ``spec``'s model and optimizer on ``device``, and its planner."""
    model, optimizer = spec.build(shape, device)
    model.train()
    planner = Planner.for_model(model, shape, device, method=spec.method, tokens=args.tokens)
    steps = packed_steps(args.warmup + 1 + args.steps, tokens_per_step=args.tokens)
    return ModelRun(spec, shape, model, optimizer, device, planner, steps, args.warmup, peak)


def bench_model(
    spec: ModelSpec, args: argparse.Namespace, device: torch.device, peak: float
) -> tuple[list[RowResult], dict[str, Any]]:
    start = time.perf_counter()
    rows = [r for r in rows_for(spec) if r.name in args.rows]
    info: dict[str, Any] = {"key": spec.key, "name": spec.key, "notes": []}

    def all_rows(status: str) -> list[RowResult]:
        return [RowResult(info["name"], r.name, status=r.skip or status) for r in rows]

    if spec.requires and importlib.util.find_spec(spec.requires) is None:
        return all_rows(f"skipped: {spec.requires} is not installed"), info
    try:
        shape = spec.load_shape()
    except ImportError as exc:
        return all_rows(f"skipped: {exc}"), info
    name = info["name"] = shape.name
    try:
        run = build(spec, shape, args, device, peak)
    except Exception as exc:  # noqa: BLE001
        return all_rows(failure_status(exc).replace("failed: ", "failed: model build: ")), info
    offload = "activations offloaded" if spec.offload else "plain gradient checkpointing (no offload at this size)"
    info["notes"] += [plan_note(run.planner), attention_line(run.planner.default), f"ftq rows: {offload}"]
    for note in info["notes"][:2]:
        print(f"# {name}: {note}", flush=True)
    print(f"# {name}: built in {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for row in rows:
        if row.skip:
            results.append(RowResult(name, row.name, status=row.skip))
            continue
        r = run_row(row, run)
        results.append(r)
        print(
            f"  {name} / {row.name}: {r.status}, {r.tokens_per_s:,.0f} tok/s, {r.peak_gib:.1f} GiB, "
            f"syncs {r.syncs_per_step}, {r.seconds:.0f} s; {'; '.join(r.installed + r.notes)}",
            flush=True,
        )
    del run
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    info["elapsed_s"] = time.perf_counter() - start
    print(f"# {name}: {info['elapsed_s']:.0f} s in all", flush=True)
    return results, info


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        from bench.moe import device_line as cuda_line

        return cuda_line()
    import transformers

    return f"cpu ({platform.machine()}); torch {torch.__version__}, transformers {transformers.__version__}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", help="models (default: all)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=[*ROWS, ALL_ON_NO_OFFLOAD])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, help=f"tokens per step ({TOKENS_PER_STEP:,})")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny Llama + GPT-OSS")
    parser.add_argument("--json", help="write all numbers to this JSON file")
    parser.add_argument(
        "--from-json", nargs="+", metavar="PATH", help="print the combined report of earlier --json files (runs nothing)"
    )
    args = parser.parse_args(argv)
    registry = TINY_MODELS if args.tiny else MODELS
    args.shapes = args.shapes or list(registry)
    unknown = sorted(set(args.shapes) - set(registry))
    if unknown and not args.from_json:
        parser.error(f"--shapes: unknown {unknown}; choose from {list(registry)}")
    args.tokens = args.tokens or (TINY_TOKENS if args.tiny else TOKENS_PER_STEP)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(report_from_json(args.from_json))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.ablation needs a CUDA device (or --device cpu --tiny)", file=sys.stderr)
        return 2
    registry = TINY_MODELS if args.tiny else MODELS
    device = torch.device(args.device)
    peak, peak_source = mfu_peak(device) if device.type == "cuda" else (math.nan, "no peak on the CPU")
    print(f"device: {device_line(device)}", flush=True)
    print(f"MFU peak: {peak:.0f} TFLOP/s bf16 ({peak_source})", flush=True)
    head = {
        "device": device_line(device),
        "matmul_peak_tflops": peak,
        "peak_source": peak_source,
        "tokens_per_step": args.tokens,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    results: list[RowResult] = []
    models: list[dict[str, Any]] = []
    for key in args.shapes:
        rs, info = bench_model(registry[key], args, device, peak)
        results += rs
        models.append(info)
        if args.json:  # after every model: a later one running out of time loses only itself
            write_json(args.json, head, models, results)
    print()
    print(report(results, models))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
