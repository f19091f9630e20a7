"""bench.evals on the CPU (the tiny shape): the eval run goes through the product's ``run_eval``
(every item generated and graded, the completions file merged), its time is split into parts that
add up to the total (grading counted by what the runner waited for it, its threads' time beside), and the sampler-alone row runs on the run's work."""

from __future__ import annotations

import json

import pytest

from bench import evals

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


def test_a_tiny_cpu_run_splits_its_time_and_reports_both_rates(tmp_path) -> None:
    out = tmp_path / "rows.json"
    code = evals.main(["--shape", "tiny", "--device", "cpu", "--items", "6", "--new-tokens", "4", "--slots", "2",
                       "--chunk", "3", "--prompt-words", "5", "--alone-prompts", "2", "--python",
                       "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert code == 0
    [row] = json.loads(out.read_text())
    assert row["shape"] == "tiny-Llama" and row["items"] == 6
    assert 0 < row["completion_tokens"] <= 6 * 4 and row["prompt_tokens"] > 6 * 5
    parts = [row[k] for k in ("loading_s", "generation_s", "grading_wait_s", "other_s")]
    assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(row["total_s"])
    assert row["grading_s"] > 0, "the python grader ran a sandboxed process per item"
    assert row["grading_workers"] >= 1, "with a python grader the items are graded on threads"
    assert row["grading_wait_s"] <= row["grading_s"] + 1e-6, "waiting for grades is at most the grading itself"
    assert row["run_tokens_per_s"] > 0 and row["alone_tokens_per_s"] > 0
    assert "2 prompts of" in row["alone_note"]
