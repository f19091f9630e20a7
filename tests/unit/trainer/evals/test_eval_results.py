"""``trainer.evals.results``: pass rules, item status and a run's totals, hand-checked."""

from __future__ import annotations

import pytest

from trainer.evals.results import grade_all, status_of, summarize, threshold

EQ = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
      "operation": "eq"}
SIM = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
       "evaluation_metric": "fuzzy_match", "pass_threshold": 0.8}


class TestThreshold:
    def test_binary_criteria_pass_at_one_and_others_at_a_half_unless_given(self):
        assert threshold(EQ) == 1.0
        assert threshold({"type": "python", "name": "p", "source": ""}) == 0.5
        assert threshold(SIM) == 0.8


class TestGradeAll:
    def test_each_criterion_scores_and_passes_by_its_threshold(self):
        results = grade_all([EQ, SIM], "Paris", {"answer": "Paris"})
        assert [(r["name"], r["score"], r["passed"], r["error"]) for r in results] == [
            ("exact", 1.0, True, None), ("close", 1.0, True, None)]
        assert status_of(results) == "pass"
        results = grade_all([EQ, SIM], "Pariss", {"answer": "Paris"})
        assert [r["passed"] for r in results] == [False, True] and status_of(results) == "fail"

    def test_a_field_the_item_lacks_errors_that_criterion_without_raising(self):
        results = grade_all([EQ, SIM], "Paris", {"question": "capital?"})
        assert all(r["error"] and "answer" in r["error"] and not r["passed"] and r["score"] == 0.0 for r in results)
        assert status_of(results) == "error"


class TestSummarize:
    def test_counts_items_by_status_and_criteria_by_passes(self):
        def line(passed: list[bool], status: str, error: str | None = None) -> dict:
            return {"status": status, "usage": {"prompt_tokens": 4, "completion_tokens": 2},
                    "results": [{"name": n, "score": 1.0 if p else 0.0, "passed": p, "error": error}
                                for n, p in zip(("exact", "close"), passed)]}

        lines = [line([True, True], "pass"), line([False, True], "fail"), line([False, False], "error", "boom"),
                 line([True, False], "fail")]
        totals = summarize(lines, [EQ, SIM])
        assert totals["result_counts"] == {"total": 4, "passed": 1, "failed": 2, "errored": 1}
        exact, close = totals["per_testing_criteria_results"]
        assert (exact["testing_criteria"], exact["passed"], exact["failed"], exact["errored"]) == ("exact", 2, 2, 1)
        assert (close["passed"], close["failed"]) == (2, 2)
        assert exact["pass_rate"] == pytest.approx(0.5) and close["mean_score"] == pytest.approx(0.5)
        assert totals["usage"] == {"prompt_tokens": 16, "completion_tokens": 8, "invocation_count": 4}

    def test_no_lines_yet_is_zero_counts_and_no_rates(self):
        totals = summarize([], [EQ])
        assert totals["result_counts"] == {"total": 0, "passed": 0, "failed": 0, "errored": 0}
        assert totals["per_testing_criteria_results"][0]["pass_rate"] is None
