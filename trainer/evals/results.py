"""How an eval run's completions are graded and counted (standard library: the API reads the
same rules to report a run's results from its lines).

Each testing criterion scores a completion (``trainer.graders.grade``) and passes when its score
reaches its ``pass_threshold``; without one, a ``string_check`` or ``label_model`` passes at 1
(it scores 1 or 0) and the others at 0.5. An item's status is ``error`` when a criterion could
not grade it (a python grader that raised or hit a limit, a template naming a field this item or
sample lacks), else ``fail`` when a criterion did not pass, else ``pass``; OpenAI's
``result_counts`` count items by it, and ``per_testing_criteria_results`` count each criterion's
passes (an errored grade is not one).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainer.graders import GraderError, SandboxLimits, grade
from trainer.graders.judge import Judges

BINARY = ("string_check", "label_model")
"""Criteria that score 1 or 0: they pass at 1 when no ``pass_threshold`` is given."""
DEFAULT_THRESHOLD = 0.5
"""Where the other criteria pass when no ``pass_threshold`` is given."""


def threshold(criterion: dict[str, Any]) -> float:
    """The score at which ``criterion`` passes."""
    given = criterion.get("pass_threshold")
    if given is not None:
        return float(given)
    return 1.0 if criterion["type"] in BINARY else DEFAULT_THRESHOLD


def grade_all(criteria: list[dict[str, Any]], output_text: str, item: Any, *, limits: SandboxLimits = SandboxLimits(),
              judge: Judges | None = None) -> list[dict[str, Any]]:
    """One result per criterion (OpenAI's output item ``results``): name, type, score, passed,
    and ``error`` (a message, or None). A failure grades that criterion ``error``, never raises."""
    results = []
    for i, criterion in enumerate(criteria):
        grader = {k: v for k, v in criterion.items() if k != "pass_threshold"}
        try:
            got = grade(grader, output_text, item, limits=limits, judge=judge, param=f"testing_criteria[{i}]")
            score, error = got.score, got.error
        except GraderError as exc:
            score, error = 0.0, exc.message
        results.append({"name": criterion["name"], "type": criterion["type"], "score": score,
                        "passed": error is None and score >= threshold(criterion), "sample": None, "error": error})
    return results


def status_of(results: list[dict[str, Any]]) -> str:
    """``error``, ``fail`` or ``pass`` (see the module docstring)."""
    if any(r.get("error") for r in results):
        return "error"
    return "pass" if all(r["passed"] for r in results) else "fail"


def summarize(lines: Iterable[dict[str, Any]], criteria: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's totals over its graded lines: ``result_counts``, ``per_testing_criteria_results``
    (with ``pass_rate`` and ``mean_score`` beside OpenAI's counts) and token ``usage``."""
    counts = {"total": 0, "passed": 0, "failed": 0, "errored": 0}
    per = [{"testing_criteria": c["name"], "passed": 0, "failed": 0, "errored": 0, "score_sum": 0.0} for c in criteria]
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "invocation_count": 0}
    for line in lines:
        counts["total"] += 1
        counts[{"pass": "passed", "fail": "failed", "error": "errored"}[line["status"]]] += 1
        for tally, result in zip(per, line["results"]):
            tally["passed" if result["passed"] else "failed"] += 1
            tally["errored"] += 1 if result.get("error") else 0
            tally["score_sum"] += float(result["score"])
        usage["invocation_count"] += 1
        for key in ("prompt_tokens", "completion_tokens"):
            usage[key] += int(line.get("usage", {}).get(key, 0))
    for tally in per:
        total = counts["total"]
        score_sum = tally.pop("score_sum")
        tally["pass_rate"] = tally["passed"] / total if total else None
        tally["mean_score"] = score_sum / total if total else None
    return {"result_counts": counts, "per_testing_criteria_results": per, "usage": usage}
