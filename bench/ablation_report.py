"""The ablation's results: one row's numbers (``RowResult``), the ratios between rows, the
markdown table, the per-model summary beside the seed's figures, and the JSON a run writes and
``--from-json`` combines (the ablation is split across device calls).

``bench.ablation`` runs the rows; this module only reads and renders their numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bench.train_step import Result as StepResult

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
    """The plan's installed pieces (``Installation.describe()``); empty for the stock row."""
    plan: list[str] = field(default_factory=list)
    """The plan's decisions that differ from the all-``auto`` plan (``bench.plans.changes``)."""
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
            lines.append(f"- all on installs: {'; '.join(on.installed + on.notes)}")
        if on is not None and on.plan:
            lines.append(f"- all on plan, where it differs from auto: {'; '.join(on.plan)}")
    return "\n".join(lines)


def report_from_json(paths: list[str]) -> str:
    """One report over several runs' JSON files (the ablation is split across device calls)."""
    results: list[RowResult] = []
    models: list[dict[str, Any]] = []
    heads = []
    for path in paths:
        with open(path) as fh:
            payload = json.load(fh)
        source = payload.get("peak_source", "8192^3 bf16 matmul measured in the run")  # older files
        heads.append(
            f"{path}: {payload['device']}; MFU peak "
            f"{payload['matmul_peak_tflops']:.0f} TFLOP/s ({source}); warmup {payload['warmup']}, "
            f"{payload['steps']} timed steps of {payload['tokens_per_step']:,} tokens"
        )
        models += payload["models"]
        results += [RowResult(**r) for r in payload["results"]]
    return "\n".join([*heads, "", report(results, models)])


def write_json(
    path: str,
    head: dict[str, Any],
    models: list[dict[str, Any]],
    results: list[RowResult],
) -> None:
    """The run's numbers: ``head`` (device, matmul_peak_tflops, peak_source, tokens_per_step, warmup, steps),
    the models' notes and every row (what ``report_from_json`` reads back)."""
    payload = {**head, "models": models, "results": [asdict(r) for r in results]}
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)

