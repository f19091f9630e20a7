"""bench.dpo on the CPU: ftq's DPO product path and TRL's DPOTrainer on the same tiny pairs, one call."""

from __future__ import annotations

import json

import pytest

from bench import dpo, product_path

pytestmark = pytest.mark.slow


class TestDpoBench:
    def test_pairs_have_openais_shape_and_the_drawn_word_counts(self, tmp_path) -> None:
        model_dir = product_path.save_model(product_path.TINY, tmp_path / "model", "cpu")
        records = dpo.write_pairs(tmp_path / "pairs.jsonl", model_dir, 6)
        assert [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()] == records
        for record in records:
            assert set(record) == {"input", "preferred_output", "non_preferred_output"}
            assert dpo.PROMPT_WORDS[0] <= len(record["input"]["messages"][0]["content"].split()) <= dpo.PROMPT_WORDS[1]
            assert dpo.ANSWER_WORDS[0] <= len(record["preferred_output"][0]["content"].split()) <= dpo.ANSWER_WORDS[1]

    def test_the_verdict_names_a_missed_target_and_more_memory(self) -> None:
        ftq = product_path.ProductResult("s", "ftq", tokens_per_s=7000.0, peak_gib=70.0)
        trl = product_path.ProductResult("s", "TRL", tokens_per_s=1400.0, peak_gib=65.8)
        assert dpo.verdict(ftq, trl) == ("ftq DPO: 7,000 real tokens/s (target >= 7,500): MISSED\n"
                                        "vs TRL: 5.00x tokens/s, peak 70.0 GiB vs 65.8 GiB (MORE)")
        ftq.tokens_per_s, ftq.peak_gib = 9000.0, 60.0
        assert "met" in dpo.verdict(ftq, trl) and "(no more)" in dpo.verdict(ftq, trl)

    def test_ftq_plans_within_trls_measured_peak(self) -> None:
        trl = product_path.ProductResult("s", "TRL", peak_gib=65.8)
        assert dpo.memory_cap(trl, dpo.parse([])) == 65.8
        assert dpo.memory_cap(trl, dpo.parse(["--set", "max_gpu_memory_gb=40"])) is None
        assert dpo.memory_cap(product_path.ProductResult("s", "TRL"), dpo.parse([])) is None  # NaN: no GPU figure
        assert dpo.memory_cap(None, dpo.parse([])) is None

    def test_tiny_cpu_run_reports_ftq_and_trl_rows_and_the_verdict(self, tmp_path, capsys) -> None:
        pytest.importorskip("trl")
        out = tmp_path / "results.json"
        code = dpo.main(["--device", "cpu", "--tiny", "--steps", "2", "--skip", "1", "--trl-batch", "2",
                         "--workdir", str(tmp_path), "--json", str(out)])
        assert code == 0
        ftq, trl = json.loads(out.read_text())
        assert trl["label"].startswith("TRL") and ftq["label"] == "ftq DPO (auto)"
        assert ftq["status"] == trl["status"] == "ok"
        assert ftq["steps_timed"] == trl["steps_timed"] == 1
        assert ftq["tokens_per_s"] > 0 and trl["tokens_per_s"] > 0
        assert all(0 < t <= 512 for t in ftq["tokens"]) and len(trl["tokens"]) == 2
        job = json.loads((tmp_path / product_path.TINY.name / "job-dpo-auto.json").read_text())
        assert (job["objective"], job["data"]["format"]) == ("dpo", "preference")
        assert "max_gpu_memory_gb" not in job  # no GPU peak from TRL on the CPU, so no cap
        printed = capsys.readouterr().out
        assert "| ftq DPO (auto) |" in printed and "| TRL DPOTrainer (batch 2) |" in printed
        assert "reward_margin" in printed and "vs TRL:" in printed and "tiny smoke run" in printed
