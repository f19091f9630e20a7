"""The full ablation of ftq's three optimizations (issue 4, section 4): one command, one table.

Run on the lent GPU::

    python -m bench.ablation [--shapes qwen3-0.6b llama-8b qwen3-14b gpt-oss-20b] [--json PATH]
                             [--warmup 2 --steps 3] [--rows ...]

``--device cpu --tiny`` runs the same row machinery on a tiny Llama and a tiny GPT-OSS on the
CPU (SDPA packed backend, offload through its synchronous CPU twin): the unit tests' smoke run.

Workload (``bench/workload.py``, as ``bench/train_step.py``): random-weight bf16 models built
on the device from config classes, LoRA r=16, lognormal samples packed into steps of 16,384
real tokens, AdamW on the adapters. Models: Qwen3-0.6B, Llama-3.1-8B, Qwen3-14B with QLoRA
(``bench/qlora.py``; skipped without bitsandbytes) and GPT-OSS-20B (LoRA on q,k,v,o and on the
expert weights through peft ``target_parameters``).

Rows, one after another on the same model object (each installs its pieces and undoes them):

- ``stock HF+peft``: one packed [1, 16384] row with restarting ``position_ids``, transformers'
  attention (sdpa; GPT-OSS has none, so ``flex_attention``, else eager in micro-batches of
  whole samples: a 16k packed eager forward needs a [64, 16k, 16k] fp32 score tensor) and HF's
  loss over full logits; MoE experts as transformers configures them.
- ``all off`` / ``metadata cache only`` / ``double-buffered reload only`` / ``MoE routing only``
  (MoE models) / ``all on``: ftq's packed attention (``trainer.attention``, Triton where it
  runs) and fused loss (``trainer.fused_loss``), plus ``trainer.lora_fused`` and
  ``trainer.fused_ops`` where the build has them; the three switches vary:
  ``packed_metadata_cache`` (metadata built once per batch vs rebuilt in every layer from the
  device position ids), ``double_buffered_reload`` (offloaded checkpoints reloaded
  double-buffered vs synchronously; offload is on in every ftq row of the 8B, 14B and 20B
  models and off for Qwen3-0.6B, whose double-buffer row is n/a) and ``moe_grouped_routing``
  (``trainer.moe_routing`` vs transformers' eager per-expert loop).

Timing is ``bench.train_step.run_variant``: warm-up steps, one step under the sync debugger
(host syncs), then timed steps with CUDA events around forward, backward and optimizer; MFU
against the bf16 matmul peak measured in the same run (MoE: active experts' FLOPs only). A
failing row prints ``failed: <error>`` and the others go on.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import math
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.train_step import Result as StepResult
from bench.train_step import matmul_peak_tflops, run_variant
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

STOCK = "stock HF+peft"
ALL_OFF = "all off"
CACHE_ONLY = "metadata cache only"
DOUBLE_ONLY = "double-buffered reload only"
MOE_ONLY = "MoE routing only"
ALL_ON = "all on"
ROWS = (STOCK, ALL_OFF, CACHE_ONLY, DOUBLE_ONLY, MOE_ONLY, ALL_ON)
ALL_ON_NO_OFFLOAD = "all on, no offload"
"""Opt-in (``--rows``): all on with plain checkpointing, what the plan's ``auto`` runs where the
activations fit (every shape here on an H200 at 16k tokens), for models whose ftq rows offload."""
NO_OFFLOAD = "n/a (no offload at this size)"
TARGET_ALL_ON = 1.25
"""Issue 4: all three on at least 1.25x all off on every model (the seed's headline)."""
EAGER_MICRO_TOKENS = 4096
"""Stock eager micro-batch: a [64, 4k, 4k] fp32 score tensor is 4 GiB (16k would be 64 GiB)."""


@dataclass(frozen=True)
class Switches:
    packed_metadata_cache: bool = False
    double_buffered_reload: bool = False
    moe_grouped_routing: bool = False


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
        "flex_attention",
        None,
        "stock: packed flex_attention (compiled; transformers has no sdpa path with sinks)",
    ),
    StockAttention(
        "eager",
        EAGER_MICRO_TOKENS,
        f"stock: eager attention in micro-batches of whole samples <= {EAGER_MICRO_TOKENS} "
        "tokens with gradient accumulation (16k packed eager needs a [64, 16k, 16k] fp32 score "
        "tensor)",
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
    "qwen3-0.6b": ModelSpec(
        "qwen3-0.6b", lambda: QWEN3_0_6B, build_lora_model, offload=False, is_moe=False
    ),
    "llama-8b": ModelSpec(
        "llama-8b", lambda: LLAMA_3_1_8B, build_lora_model, offload=True, is_moe=False
    ),
    "qwen3-14b": ModelSpec(
        "qwen3-14b",
        _qlora_shape,
        _build_qlora,
        offload=True,
        is_moe=False,
        method="qlora",
        requires="bitsandbytes",
    ),
    "gpt-oss-20b": ModelSpec(
        "gpt-oss-20b",
        lambda: GPT_OSS_20B,
        build_lora_model,
        offload=True,
        is_moe=True,
        stock=GPT_OSS_STOCK,
    ),
}
TINY_LLAMA = ModelShape("tiny-Llama", "llama", 64, 2, 4, 2, 16, 128, 512)
TINY_GPT_OSS = ModelShape(
    "tiny-GPT-OSS", "gpt_oss", 64, 2, 4, 2, 16, 64, 512, 4, 2, sliding_window=8
)
TINY_MODELS = {
    "tiny-llama": ModelSpec(
        "tiny-llama", lambda: TINY_LLAMA, build_lora_model, offload=True, is_moe=False
    ),
    "tiny-gpt-oss": ModelSpec(
        "tiny-gpt-oss",
        lambda: TINY_GPT_OSS,
        build_lora_model,
        offload=True,
        is_moe=True,
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


def restore_experts(model: torch.nn.Module) -> None:
    """Undo ``trainer.moe_routing.install``: transformers' own experts dispatch again.

    ``install`` sets ``forward`` on each experts instance; the class's (decorated) forward
    follows ``config._experts_implementation``, what stock transformers runs.
    """
    from trainer import moe_routing

    for _, module in moe_routing.experts_modules(model):
        vars(module).pop("forward", None)


def _unwrap(model: torch.nn.Module) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class AblationRow:
    """One row on ``model``: ``install`` its pieces, ``micro_batches`` per step, ``close`` undoes.

    ``name``, ``device`` and ``micro_batches`` are what ``bench.train_step.run_variant`` times.
    """

    def __init__(
        self,
        spec: RowSpec,
        model_spec: ModelSpec,
        model: torch.nn.Module,
        shape: ModelShape,
        device: torch.device,
        stock: StockAttention | None = None,
    ) -> None:
        self.name, self.spec, self.model_spec = spec.name, spec, model_spec
        self.model, self.shape, self.device, self.stock = model, shape, device, stock
        self.attention: Any = None
        self.offloader: Any = None
        self.installed: list[str] = []
        self.notes: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        if self.spec.switches is None:
            self._install_stock()
        else:
            self._install_ftq(self.spec.switches)

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _install_stock(self) -> None:
        assert self.stock is not None, "the stock row needs a StockAttention"
        lm = _unwrap(self.model)
        if self.model_spec.is_moe:
            restore_experts(self.model)
            experts = getattr(lm.config, "_experts_implementation", None)
            self.notes.append(f"stock experts: transformers' {experts}")
        previous = lm.config._attn_implementation
        if previous != self.stock.implementation:
            lm.set_attn_implementation(self.stock.implementation)
            self._undo.append(lambda: lm.set_attn_implementation(previous))
        self.notes.append(self.stock.note)

    def _install_ftq(self, switches: Switches) -> None:
        from trainer.attention import PackedAttention

        backend = self._backend()
        self.attention = PackedAttention(backend, cache=switches.packed_metadata_cache)
        self.attention.install(self.model)
        self._undo.append(self.attention.uninstall)
        how = "cached" if switches.packed_metadata_cache else "rebuilt per layer"
        self.installed.append(f"packed attention ({backend}, metadata {how})")
        for name in ("lora_fused", "fused_ops"):
            try:
                module = importlib.import_module(f"trainer.{name}")
            except ImportError:
                continue
            self._undo.append(module.install(self.model).uninstall)
            self.installed.append(name)
        if self.model_spec.is_moe:
            from trainer import moe_routing

            routing = moe_routing.install(self.model, switches.moe_grouped_routing)
            self._undo.append(lambda: restore_experts(self.model))
            self.notes.append(routing.describe())
        if self.model_spec.offload and self.spec.offload:
            from trainer import offload

            offloader = offload.build(
                self.device,
                offload=True,
                double_buffer=switches.double_buffered_reload,
            )
            offloader.apply(self.model)
            self.offloader = offloader
            self._undo.append(lambda: offloader.remove(self.model))
            how = "double-buffered" if switches.double_buffered_reload else "sync"
            self.installed.append(f"offload ({how} reload)")

    def _backend(self) -> str:
        from trainer.attention import choose_backend, supported

        config = _unwrap(self.model).config
        if self.device.type != "cuda":
            return "sdpa"
        reason = supported("triton", self.device, config)
        if reason is None:
            return "triton"
        backend, _ = choose_backend(self.device, config)
        self.notes.append(f"triton cannot run here ({reason}): {backend}")
        return backend

    def micro_batches(self, lengths: list[int], seed: int) -> list[Callable[[], Any]]:
        """The step as closures, each returning (loss to backpropagate, real tokens)."""
        vocab = self.shape.vocab
        if self.spec.switches is not None:

            def packed() -> tuple[torch.Tensor, int]:
                from trainer.fused_loss import causal_lm_loss

                batch = packed_batch(lengths, vocab, self.device, seed)
                meta = self.attention.metadata(lengths, self.device)
                loss = causal_lm_loss(
                    self.model,
                    batch.input_ids,
                    batch.targets,
                    num_items=batch.num_label_tokens,
                    **meta.model_kwargs(),
                )
                return loss, sum(lengths)

            return [packed]
        assert self.stock is not None
        total_labels = sum(n - 1 for n in lengths)

        def stock(group: list[int], k: int) -> tuple[torch.Tensor, int]:
            batch = packed_batch(group, vocab, self.device, seed * 1000 + k)
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                labels=batch.labels,
            )
            # HF's loss is the micro-batch mean: weight it by its share of the step's labels.
            return out.loss * (sum(n - 1 for n in group) / total_labels), sum(group)

        groups = micro_groups(lengths, self.stock.micro_tokens)
        return [lambda g=g, k=k: stock(g, k) for k, g in enumerate(groups)]


# -- results ----------------------------------------------------------------------------------


@dataclass
class RowResult:
    model: str
    row: str
    status: str = "ok"
    """``ok``, ``failed: <error>``, ``skipped: <why>`` or ``n/a (<why>)``."""
    tokens_per_s: float = math.nan
    step_ms: float = math.nan
    forward_ms: float = math.nan
    backward_ms: float = math.nan
    optimizer_ms: float = math.nan
    peak_gib: float = math.nan
    mfu: float = math.nan
    syncs_per_step: int = -1
    """-1: not counted (CPU)."""
    sync_sites: list[str] = field(default_factory=list)
    second_buffer_gib: float = 0.0
    installed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    seconds: float = math.nan
    """Wall time of the whole row (install, warm-up, sync count, timed steps)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_step(cls, model: str, row: str, step: StepResult) -> RowResult:
        return cls(model, row, **{k: getattr(step, k) for k in _STEP_FIELDS})


_STEP_FIELDS = (
    "tokens_per_s",
    "step_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "peak_gib",
    "mfu",
    "syncs_per_step",
    "sync_sites",
    "losses",
)
"""What a row takes over from ``bench.train_step.Result``."""


@dataclass(frozen=True)
class Derived:
    """A row against its model's ``all off`` and ``stock`` rows (NaN where either is missing)."""

    extra_gib: float
    vs_all_off: float
    vs_stock: float


def _ratio(a: RowResult | None, b: RowResult | None) -> float:
    if a is None or b is None or not (a.ok and b.ok) or not b.tokens_per_s > 0:
        return math.nan
    return a.tokens_per_s / b.tokens_per_s


def _find(results: Iterable[RowResult], model: str, row: str) -> RowResult | None:
    return next((r for r in results if r.model == model and r.row == row), None)


def derive(results: list[RowResult], r: RowResult) -> Derived:
    base = _find(results, r.model, ALL_OFF)
    ok_base = base is not None and base.ok and r.ok
    extra = r.peak_gib - base.peak_gib if ok_base else math.nan
    return Derived(extra, _ratio(r, base), _ratio(r, _find(results, r.model, STOCK)))


def failure_status(exc: BaseException) -> str:
    """``failed: <error>`` on one table-safe line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    kind = "OOM" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
    return f"failed: {kind}: {first[:160]}".replace("|", "/")


def _num(x: float, fmt: str) -> str:
    return "" if x is None or math.isnan(x) else format(x, fmt)


def _times(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.2f}x"


HEADER = (
    "| model | row | tokens/s | step ms | fwd ms | bwd ms | peak GiB | extra GiB vs all off "
    "| MFU | host syncs/step | vs all off | vs stock |"
)


def markdown_table(results: list[RowResult]) -> str:
    lines = [HEADER, "|---|---|" + "---:|" * 10]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.model} | {r.row} | {r.status} |" + " |" * 9)
            continue
        d = derive(results, r)
        syncs = "" if r.syncs_per_step < 0 else str(r.syncs_per_step)
        cells = [
            _num(r.tokens_per_s, ",.0f"),
            _num(r.step_ms, ".0f"),
            _num(r.forward_ms, ".0f"),
            _num(r.backward_ms, ".0f"),
            _num(r.peak_gib, ".2f"),
            _num(d.extra_gib, "+.2f"),
            _num(r.mfu, ".1%"),
            syncs,
            _times(d.vs_all_off),
            _times(d.vs_stock),
        ]
        lines.append(f"| {r.model} | {r.row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SEED_DOUBLE = {
    "Llama-3.1-8B": "+8.4% on 8B, 0.37 GB extra, B200",
    "Qwen3-14B": "+6.7% on 14B, B200",
}
SEED_DOUBLE_OTHER = "none at this size (+8.4% 8B, +6.7% 14B, +4.6% 32B on B200)"
SEED = {
    CACHE_ONLY: "+14.3% per batch",
    MOE_ONLY: "10-15% end to end on GPT-OSS-20B",
}
"""The seed's figures each optimization's own gain is printed beside (issue 4)."""


def _gain(r: RowResult | None, base: RowResult | None) -> str:
    ratio = _ratio(r, base)
    if not math.isnan(ratio):
        return f"{ratio - 1:+.1%}"
    if r is None or not r.ok:
        return f"n/a ({r.status if r is not None else 'missing'})"
    return f"n/a (all off: {base.status if base is not None else 'missing'})"


def summary(results: list[RowResult], model: str) -> list[str]:
    """Per model: all on / all off, each optimization's own gain beside its seed figure, vs stock."""
    off, on = _find(results, model, ALL_OFF), _find(results, model, ALL_ON)
    stock = _find(results, model, STOCK)
    lines = [f"### {model}"]
    ratio = _ratio(on, off)
    verdict = (
        "" if math.isnan(ratio) else (" met" if ratio >= TARGET_ALL_ON else " MISSED")
    )
    lines.append(
        f"- all on / all off: {_times(ratio) or 'n/a'} (target >= {TARGET_ALL_ON}x){verdict}"
    )
    for row in (CACHE_ONLY, DOUBLE_ONLY, MOE_ONLY):
        r = _find(results, model, row)
        if r is None:
            continue
        if r.status.startswith("n/a"):
            lines.append(f"- {row}: {r.status}")
            continue
        seed = SEED.get(row) or SEED_DOUBLE.get(model, SEED_DOUBLE_OTHER)
        extra = ""
        if row == DOUBLE_ONLY and r.ok:
            d = derive(results, r)
            extra = (
                f"; second buffer {r.second_buffer_gib:.3f} GiB, peak "
                f"{_num(d.extra_gib, '+.2f') or 'n/a'} GiB vs all off"
            )
        lines.append(f"- {row} vs all off: {_gain(r, off)} (seed: {seed}){extra}")
    ahead = _ratio(on, stock)
    verdict = "" if math.isnan(ahead) else (" ahead" if ahead > 1 else " BEHIND")
    lines.append(f"- all on / stock HF+peft: {_times(ahead) or 'n/a'}{verdict}")
    plain = _find(results, model, ALL_ON_NO_OFFLOAD)
    if plain is not None:
        lines.append(
            f"- {ALL_ON_NO_OFFLOAD} / all on: {_times(_ratio(plain, on)) or plain.status}"
            f", / stock HF+peft: {_times(_ratio(plain, stock)) or 'n/a'}"
        )
    return lines


# -- running ----------------------------------------------------------------------------------


def time_row(
    row: AblationRow,
    optimizer: Any,
    steps: list[list[int]],
    warmup: int,
    peak_tflops: float,
    shape: ModelShape,
) -> StepResult:
    """``bench.train_step.run_variant`` on CUDA; on the CPU the same steps by wall clock."""
    if row.device.type == "cuda":
        return run_variant(row, optimizer, steps, warmup, peak_tflops, shape)
    result = StepResult(shape.name, row.name)
    timed = range(warmup + 1, len(steps))
    fwd = bwd = opt = wall = 0.0
    tokens = 0
    for i in range(len(steps)):
        step_start, loss_sum = time.perf_counter(), 0.0
        for micro_batch in row.micro_batches(steps[i], seed=i):
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


def run_row(
    spec: RowSpec,
    model_spec: ModelSpec,
    model: torch.nn.Module,
    optimizer: Any,
    shape: ModelShape,
    device: torch.device,
    steps: list[list[int]],
    warmup: int,
    peak_tflops: float,
) -> RowResult:
    """One row; the stock row tries ``model_spec.stock`` in order until one runs."""
    attempts: tuple[StockAttention | None, ...] = (
        model_spec.stock if spec.switches is None else (None,)
    )
    failures: list[str] = []
    start = time.perf_counter()
    result = RowResult(shape.name, spec.name, status="failed: nothing ran")
    for stock in attempts:
        row = AblationRow(spec, model_spec, model, shape, device, stock)
        try:
            row.install()
            step = time_row(row, optimizer, steps, warmup, peak_tflops, shape)
            result = RowResult.from_step(shape.name, spec.name, step)
            if row.offloader is not None:
                result.second_buffer_gib = row.offloader.extra_gpu_bytes / 2**30
        except Exception as exc:  # noqa: BLE001 - one broken row must not hide the others
            result = RowResult(shape.name, spec.name, status=failure_status(exc))
            if stock is not None:
                failures.append(f"{stock.implementation}: {result.status}")
        finally:
            row.close()
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()  # fresh AdamW state per row
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result.installed, result.notes = row.installed, row.notes + failures
        if result.ok:
            break
    result.seconds = time.perf_counter() - start
    return result


def plan_note(spec: ModelSpec, shape: ModelShape, hw: Any, tokens: int) -> str:
    """What ``trainer.hardware.plan`` decides on ``auto`` for offload and its reload on ``hw``
    (a ``trainer.hardware.Hardware``; the weights' size comes from ``shape.param_count``)."""
    if isinstance(hw, Exception):
        return f"plan on auto here: hardware not detected ({type(hw).__name__}: {hw})"
    try:
        from trainer.config import (
            DataConfig,
            ModelConfig,
            OptimConfig,
            Optimizations,
            TrainConfig,
        )
        from trainer.hardware import ModelFacts, plan

        config = TrainConfig(
            model=ModelConfig(f"bench/{shape.name}"),
            data=DataConfig(
                "bench.jsonl", max_seq_len=min(4096, tokens), batch_tokens=tokens
            ),
            optim=OptimConfig(max_steps=1),
            output_dir="bench-out",
            method=spec.method,
        )
        facts = ModelFacts(
            model_type=shape.family,
            is_moe=shape.is_moe,
            num_layers=shape.layers,
            hidden_size=shape.hidden,
            param_count=shape.param_count(),
            moe_blocks=shape.layers if shape.is_moe else 0,
            head_dim=shape.head_dim,
            sliding_window=bool(shape.sliding_window),
            attention_sinks=shape.family == "gpt_oss",
            grouped_query=shape.kv_heads < shape.heads,
        )
        chosen = plan(hw, Optimizations(), config, facts)
        parts = []
        for name in ("offload_activations", "double_buffered_reload"):
            d = chosen.decision(name)
            parts.append(f"{name} {'on' if d.enabled else 'off'} ({d.reason})")
        return "plan on auto here: " + "; ".join(parts)
    except Exception as exc:  # noqa: BLE001 - a note, not a result
        return f"plan on auto here: could not plan ({type(exc).__name__}: {exc})"


def _hardware(device: torch.device) -> Any:
    """``trainer.hardware.detect`` for ``device``, or the error (a note, not a failure)."""
    try:
        from trainer.hardware import detect

        return detect(device.type)
    except Exception as exc:  # noqa: BLE001
        return exc


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
    info["name"] = shape.name
    info["notes"].append(plan_note(spec, shape, _hardware(device), args.tokens))
    info["notes"].append(
        "ftq rows: activations offloaded"
        if spec.offload
        else "ftq rows: plain gradient checkpointing (no offload at this size)"
    )
    print(f"# {shape.name}: {info['notes'][0]}", flush=True)
    try:
        model, optimizer = spec.build(shape, device)
    except Exception as exc:  # noqa: BLE001
        return all_rows(
            failure_status(exc).replace("failed: ", "failed: model build: ")
        ), info
    model.train()
    print(f"# {shape.name}: built in {time.perf_counter() - start:.0f} s", flush=True)
    steps = packed_steps(args.warmup + 1 + args.steps, tokens_per_step=args.tokens)
    results = []
    for row in rows:
        if row.skip:
            results.append(RowResult(shape.name, row.name, status=row.skip))
            continue
        r = run_row(
            row, spec, model, optimizer, shape, device, steps, args.warmup, peak
        )
        results.append(r)
        print(
            f"  {shape.name} / {row.name}: {r.status}, {r.tokens_per_s:,.0f} tok/s, "
            f"{r.peak_gib:.1f} GiB, syncs {r.syncs_per_step}, {r.seconds:.0f} s; "
            f"{', '.join(r.installed + r.notes)}",
            flush=True,
        )
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    info["elapsed_s"] = time.perf_counter() - start
    print(f"# {shape.name}: {info['elapsed_s']:.0f} s in all", flush=True)
    return results, info


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        from bench.moe import device_line as cuda_line

        return cuda_line()
    import transformers

    return (
        f"cpu ({platform.machine()}); torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", help="models (default: all)")
    parser.add_argument(
        "--rows", nargs="+", default=list(ROWS), choices=[*ROWS, ALL_ON_NO_OFFLOAD]
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--tokens", type=int, help=f"tokens per step ({TOKENS_PER_STEP:,})"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny Llama + GPT-OSS")
    parser.add_argument("--json", help="write all numbers to this JSON file")
    parser.add_argument(
        "--from-json",
        nargs="+",
        metavar="PATH",
        help="print the combined report of earlier --json files (runs nothing)",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        print(report_from_json(args.from_json))
        return 0
    registry = TINY_MODELS if args.tiny else MODELS
    args.shapes = args.shapes or list(registry)
    unknown = sorted(set(args.shapes) - set(registry))
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {list(registry)}")
    args.tokens = args.tokens or (TINY_TOKENS if args.tiny else TOKENS_PER_STEP)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench.ablation needs a CUDA device (or --device cpu --tiny)",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device)
    peak = matmul_peak_tflops(device) if device.type == "cuda" else math.nan
    print(f"device: {device_line(device)}", flush=True)
    print(f"bf16 matmul peak (8192^3, measured): {peak:.0f} TFLOP/s", flush=True)
    results: list[RowResult] = []
    models: list[dict[str, Any]] = []
    for key in args.shapes:
        rs, info = bench_model(registry[key], args, device, peak)
        results += rs
        models.append(info)
        if (
            args.json
        ):  # after every model: a later one running out of time loses only itself
            write_json(args, device, peak, models, results)
    print()
    print(report(results, models))
    return 0


def report(results: list[RowResult], models: list[dict[str, Any]]) -> str:
    """The markdown table, then per model its summary and notes."""
    lines = [markdown_table(results)]
    for info in models:
        lines += ["", *summary(results, info["name"])]
        lines += [f"- {note}" for note in info["notes"]]
        lines.append(f"- elapsed: {info.get('elapsed_s', math.nan):.0f} s")
        stock = _find(results, info["name"], STOCK)
        if stock is not None and stock.notes:
            lines.append(f"- stock row: {'; '.join(stock.notes)}")
        on = _find(results, info["name"], ALL_ON)
        if on is not None and on.installed:
            lines.append(f"- ftq rows install: {', '.join(on.installed + on.notes)}")
    return "\n".join(lines)


def report_from_json(paths: list[str]) -> str:
    """One report over several runs' JSON files (the ablation is split across device calls)."""
    results: list[RowResult] = []
    models: list[dict[str, Any]] = []
    heads = []
    for path in paths:
        with open(path) as fh:
            payload = json.load(fh)
        heads.append(
            f"{path}: {payload['device']}; bf16 matmul peak "
            f"{payload['matmul_peak_tflops']:.0f} TFLOP/s; warmup {payload['warmup']}, "
            f"{payload['steps']} timed steps of {payload['tokens_per_step']:,} tokens"
        )
        models += payload["models"]
        results += [RowResult(**r) for r in payload["results"]]
    return "\n".join([*heads, "", report(results, models)])


def write_json(
    args: argparse.Namespace,
    device: torch.device,
    peak: float,
    models: list[dict[str, Any]],
    results: list[RowResult],
) -> None:
    payload = {
        "device": device_line(device),
        "matmul_peak_tflops": peak,
        "tokens_per_step": args.tokens,
        "warmup": args.warmup,
        "steps": args.steps,
        "models": models,
        "results": [asdict(r) for r in results],
    }
    with open(args.json, "w") as fh:
        json.dump(payload, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
