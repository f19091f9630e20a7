"""bench.ablation without a GPU: the rows per model, the ratios, the table, and a tiny CPU run.

The arithmetic and rendering tests use hand-made results (exact numbers, exact strings). The
smoke test runs ``python -m bench.ablation --device cpu --tiny`` (a tiny Llama and a tiny
GPT-OSS, the plan's SDPA packed backend, offload over its synchronous CPU streams) in a
subprocess and checks that every row ran and produced finite numbers with the pieces its plan
should install.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import ablation, ablation_report
from bench.ablation import MODELS, Switches, micro_groups, rows_for
from bench.ablation_report import (
    ALL_OFF,
    ALL_ON,
    ALL_ON_NO_OFFLOAD,
    CACHE_ONLY,
    DOUBLE_ONLY,
    MOE_ONLY,
    NO_OFFLOAD,
    STOCK,
    RowResult,
    derive,
    failure_status,
    markdown_table,
    summary,
)
from trainer.config import SWITCHES

REPO_ROOT = Path(__file__).resolve().parents[3]


def _ok(model: str, row: str, tps: float, peak: float, **kw) -> RowResult:
    return RowResult(
        model,
        row,
        tokens_per_s=tps,
        step_ms=16384 / tps * 1e3,
        forward_ms=100.0,
        backward_ms=200.0,
        peak_gib=peak,
        mfu=0.25,
        syncs_per_step=0,
        **kw,
    )


def _fake_results() -> list[RowResult]:
    m = "Llama-3.1-8B"
    return [
        _ok(m, STOCK, 650.0, 47.0),
        _ok(m, ALL_OFF, 1000.0, 10.0),
        _ok(m, CACHE_ONLY, 1100.0, 10.0),
        _ok(m, DOUBLE_ONLY, 1050.0, 10.5, second_buffer_gib=0.125),
        RowResult(m, ALL_ON, status="failed: OOM: CUDA out of memory / tried 2 GiB"),
    ]


class TestRowsFor:
    def test_small_dense_model_has_no_double_buffer_row_to_run(self):
        rows = rows_for(MODELS["qwen3-0.6b"])
        assert [r.name for r in rows] == [
            STOCK,
            ALL_OFF,
            CACHE_ONLY,
            DOUBLE_ONLY,
            ALL_ON,
        ]
        assert rows[3].skip == NO_OFFLOAD
        assert rows[0].switches is None
        assert rows[-1].switches == Switches(True, False, False)

    def test_offloaded_dense_model_runs_the_double_buffer_row(self):
        rows = {r.name: r for r in rows_for(MODELS["llama-8b"])}
        assert MOE_ONLY not in rows
        assert rows[DOUBLE_ONLY].skip is None
        assert rows[ALL_ON].switches == Switches(True, True, False)
        assert rows[ALL_ON_NO_OFFLOAD].offload is False

    def test_moe_model_has_a_routing_row_and_all_three_on(self):
        rows = {r.name: r for r in rows_for(MODELS["gpt-oss-20b"])}
        assert rows[MOE_ONLY].switches == Switches(moe_grouped_routing=True)
        assert rows[ALL_ON].switches == Switches(True, True, True)
        assert ablation.ROWS == (
            STOCK,
            ALL_OFF,
            CACHE_ONLY,
            DOUBLE_ONLY,
            MOE_ONLY,
            ALL_ON,
        )

    @pytest.mark.parametrize("key", list(MODELS))
    def test_each_only_row_differs_from_all_off_in_exactly_one_switch(self, key):
        rows = {r.name: r for r in rows_for(MODELS[key])}
        off = rows[ALL_OFF].switches
        for name in (CACHE_ONLY, DOUBLE_ONLY, MOE_ONLY):
            if name in rows:
                only = rows[name].switches
                diff = [f for f in vars(off) if getattr(off, f) != getattr(only, f)]
                assert len(diff) == 1, (key, name, diff)

    def test_rows_become_the_plans_switches(self):
        rows = {r.name: r for r in rows_for(MODELS["gpt-oss-20b"])}
        off = rows[ALL_OFF].switches.optimizations(offload=True)
        assert off == {
            "packed_metadata_cache": "off",
            "double_buffered_reload": "off",
            "moe_grouped_routing": "off",
            "offload_activations": "on",
        }
        assert set(off) == set(SWITCHES)
        on = rows[ALL_ON].switches.optimizations(offload=True)
        assert set(on.values()) == {"on"}
        plain = rows[ALL_ON_NO_OFFLOAD].switches.optimizations(offload=False)
        assert (plain["offload_activations"], plain["double_buffered_reload"]) == ("off", "off")

    def test_qlora_model_needs_bitsandbytes(self):
        spec = MODELS["qwen3-14b"]
        assert (spec.method, spec.requires, spec.offload) == (
            "qlora",
            "bitsandbytes",
            True,
        )


class TestMicroGroups:
    def test_whole_samples_up_to_the_budget(self):
        lengths = [3000, 1000, 500, 4096, 10]
        groups = micro_groups(lengths, 4096)
        assert groups == [[3000, 1000], [500], [4096], [10]]
        assert [n for g in groups for n in g] == lengths

    def test_no_budget_is_one_packed_row(self):
        assert micro_groups([5, 7], None) == [[5, 7]]


class TestDerive:
    def test_ratios_and_extra_memory_against_all_off_and_stock(self):
        results = _fake_results()
        d = derive(results, results[2])  # metadata cache only
        assert d.vs_all_off == pytest.approx(1.1, rel=1e-12)
        assert d.vs_stock == pytest.approx(1100 / 650, rel=1e-12)
        assert d.extra_gib == pytest.approx(0.0, abs=1e-12)
        assert derive(results, results[3]).extra_gib == pytest.approx(0.5, abs=1e-12)

    def test_failed_row_or_baseline_gives_nan(self):
        results = _fake_results()
        assert math.isnan(derive(results, results[4]).vs_all_off)
        results[1] = RowResult(results[1].model, ALL_OFF, status="failed: boom")
        d = derive(results, results[2])
        assert math.isnan(d.vs_all_off) and math.isnan(d.extra_gib)
        assert d.vs_stock == pytest.approx(1100 / 650, rel=1e-12)


class TestMarkdown:
    def test_ok_rows_render_every_column(self):
        lines = markdown_table(_fake_results()).splitlines()
        assert lines[0].startswith("| model | row | tokens/s |")
        assert lines[4] == (
            "| Llama-3.1-8B | metadata cache only | 1,100 | 14895 | 100 | 200 | 10.00 "
            "| +0.00 | 25.0% | 0 | 1.10x | 1.69x |"
        )
        assert "| 10.50 | +0.50 |" in lines[5]

    def test_failure_row_keeps_the_column_count(self):
        lines = markdown_table(_fake_results()).splitlines()
        failed = lines[-1]
        assert failed.startswith(
            "| Llama-3.1-8B | all on | failed: OOM: CUDA out of memory / tried 2 GiB |"
        )
        assert failed.count("|") == lines[0].count("|") == 13

    def test_failure_status_is_one_table_safe_line(self):
        exc = torch.OutOfMemoryError("CUDA out of memory. Tried | 2 GiB\nsecond line")
        assert failure_status(exc) == "failed: OOM: CUDA out of memory. Tried / 2 GiB"
        assert failure_status(ValueError("bad")) == "failed: ValueError: bad"


class TestSummary:
    def test_gains_beside_seed_figures_and_missing_rows_named(self):
        text = "\n".join(summary(_fake_results(), "Llama-3.1-8B"))
        assert "- all on / all off: n/a (target >= 1.25x)" in text
        assert (
            "- metadata cache only vs all off: +10.0% (seed: +14.3% per batch)" in text
        )
        assert (
            "- double-buffered reload only vs all off: +5.0% (seed: +8.4% on 8B, 0.37 GB "
            "extra, B200); second buffer 0.125 GiB, peak +0.50 GiB vs all off"
        ) in text
        assert "- all on / stock HF+peft: n/a" in text

    def test_targets_met_and_missed(self):
        results = _fake_results()[:3]
        results.append(_ok("Llama-3.1-8B", ALL_ON, 1240.0, 10.0))
        text = "\n".join(summary(results, "Llama-3.1-8B"))
        assert "all on / all off: 1.24x (target >= 1.25x) MISSED" in text
        assert "all on / stock HF+peft: 1.91x ahead" in text

    def test_no_offload_row_says_n_a(self):
        results = [RowResult("Qwen3-0.6B", DOUBLE_ONLY, status=NO_OFFLOAD)]
        assert f"- {DOUBLE_ONLY}: {NO_OFFLOAD}" in summary(results, "Qwen3-0.6B")


@pytest.mark.slow  # ~22 s on 2 CPU cores: every ablation row trains tiny Llama and GPT-OSS
class TestTinyCpuRun:
    def test_every_row_of_tiny_llama_and_gpt_oss_produces_numbers(self, tmp_path):
        out = tmp_path / "ablation.json"
        rows = [*ablation.ROWS, ALL_ON_NO_OFFLOAD]
        cmd = [sys.executable, "-m", "bench.ablation", "--device", "cpu", "--tiny"]
        cmd += ["--warmup", "0", "--steps", "1", "--json", str(out), "--rows", *rows]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "| model | row | tokens/s |" in proc.stdout
        results = json.loads(out.read_text())["results"]
        by = {(r["model"], r["row"]): r for r in results}
        dense = [STOCK, ALL_OFF, CACHE_ONLY, DOUBLE_ONLY, ALL_ON, ALL_ON_NO_OFFLOAD]
        expected = [("tiny-Llama", r) for r in dense]
        expected += [("tiny-GPT-OSS", r) for r in dense[:4] + [MOE_ONLY] + dense[4:]]
        assert [(r["model"], r["row"]) for r in results] == expected
        for key, r in by.items():
            assert r["status"] == "ok", (key, r["status"])
            assert r["tokens_per_s"] > 0 and r["step_ms"] > 0, key
            assert r["losses"] and all(math.isfinite(x) for x in r["losses"]), key
        for model in ("tiny-Llama", "tiny-GPT-OSS"):
            off, on = by[model, ALL_OFF], by[model, ALL_ON]
            # Installation.describe() of each row's plan
            assert "packed attention: sdpa, metadata built in every layer" in off["installed"]
            assert "packed attention: sdpa, metadata built once per batch" in on["installed"]
            assert "activation offload: 2 decoder layers, synchronous reload" in off["installed"]
            assert "activation offload: 2 decoder layers, double-buffered reload" in on["installed"]
            assert any(i.startswith("LoRA kernel: ") for i in on["installed"])
            assert "loss: fused_chunked_ce" in on["installed"]
            assert not any(
                i.startswith("activation offload")
                for i in by[model, ALL_ON_NO_OFFLOAD]["installed"]
            )
            assert by[model, STOCK]["installed"] == [] and by[model, STOCK]["plan"] == []
            # the decisions unlike the all-auto plan: the cache off, the offload forced on
            assert any(p.startswith("packed_metadata_cache: off (sdpa)") for p in off["plan"])
            assert any(p.startswith("offload_activations: on (sync)") for p in off["plan"])
            assert any(p.startswith("offload_activations: on (double)") for p in on["plan"])
            assert not any(p.startswith("packed_metadata_cache") for p in on["plan"])
        # The report rebuilt from the JSON (how split device runs are combined) is the
        # report the run printed.
        rebuilt = ablation_report.report_from_json([str(out)])
        assert rebuilt.split("\n\n", 1)[1] in proc.stdout
        moe_off = " ".join(by["tiny-GPT-OSS", ALL_OFF]["installed"])
        moe_on = " ".join(by["tiny-GPT-OSS", MOE_ONLY]["installed"])
        assert "eager per-expert loop" in moe_off and "grouped routing" in moe_on
        assert not any("MoE" in i for i in by["tiny-Llama", ALL_ON]["installed"])
