"""Grade one model output against one item: ``grade(grader, output_text, item) -> GradeResult``.

The grader is one ``spec.validate`` returned. Templates are rendered first: a template naming a
field the item or sample lacks raises ``GraderError`` (the caller's input is wrong). What goes
wrong inside a grader (a python grader's exception or limit, a judge's unreadable answer, a
formula's division by zero) does not raise: the result has score 0, the error's flag set in
OpenAI's ``metadata.errors`` names and a message, so one item's failure never stops a run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trainer.graders.errors import GraderError
from trainer.graders.formula import evaluate, parse_formula
from trainer.graders.judge import Judges, JudgeAnswerError, judge_grade
from trainer.graders.sandbox import SandboxLimits, run_python
from trainer.graders.template import render, sample_namespace
from trainer.graders.text import similarity, string_check

ERROR_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error",
               "model_grader_refusal_error", "model_grader_server_error", "other_error", "python_grader_runtime_error",
               "python_grader_server_error", "sample_parse_error", "truncated_observation_error",
               "unresponsive_reward_error")
"""OpenAI's ``metadata.errors`` flags (``GraderRunResponse``)."""
MODEL_GRADERS = ("score_model", "label_model")


@dataclass
class GradeResult:
    score: float
    """The reward: 0 when the item failed."""
    name: str
    type: str
    sub_scores: dict[str, float] = field(default_factory=dict)
    """A multi grader's graders' scores by name."""
    errors: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(ERROR_FLAGS, False))
    error: str | None = None
    """What failed, for this item; None when it graded."""
    error_type: str | None = None
    """For a python grader's failure: ``runtime``, ``refused``, ``memory``, ``cpu``, ``wall``, ``output``."""
    log: str = ""
    """What a python grader printed, or a judge's raw answer."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def uses_model(grader: dict[str, Any]) -> bool:
    """Whether grading needs a judge model (a model grader, or a multi grader holding one)."""
    return bool(model_graders(grader))


def model_graders(grader: dict[str, Any], param: str = "grader") -> list[tuple[str, dict[str, Any]]]:
    """Each model grader in ``grader`` (itself, or a multi grader's) with its field path:
    ``[("grader", g)]``, ``[("grader.graders.judge", g)]``; its ``model`` names the judge."""
    if grader["type"] == "multi":
        return [found for key, sub in grader["graders"].items()
                for found in model_graders(sub, f"{param}.graders.{key}")]
    return [(param, grader)] if grader["type"] in MODEL_GRADERS else []


def grade(grader: dict[str, Any], output_text: str, item: Any, *, limits: SandboxLimits = SandboxLimits(),
          judge: Judges | None = None, param: str = "grader") -> GradeResult:
    """Raises ``GraderError`` for a template naming a missing field, or a model grader with no judge."""
    started = time.monotonic()
    namespaces = {"item": item, "sample": sample_namespace(output_text)}
    if grader["type"] == "multi":
        result = _multi(grader, namespaces, limits, judge, param)
    else:
        result = _one(grader, namespaces, limits, judge, param)
    result.seconds = time.monotonic() - started
    return result


def _one(grader: dict[str, Any], namespaces: dict[str, Any], limits: SandboxLimits, judge: Judges | None,
         param: str) -> GradeResult:
    kind, name = grader["type"], grader["name"]
    if kind == "string_check":
        text, reference = _pair(grader, namespaces, param)
        return GradeResult(string_check(grader["operation"], text, reference), name, kind)
    if kind == "text_similarity":
        text, reference = _pair(grader, namespaces, param)
        return GradeResult(similarity(grader["evaluation_metric"], text, reference), name, kind)
    if kind == "python":
        outcome = run_python(grader["source"], namespaces["sample"], namespaces["item"], limits)
        if outcome.score is not None:
            return GradeResult(outcome.score, name, kind, log=outcome.log)
        flag = "python_grader_runtime_error" if outcome.kind in ("runtime", "refused") else "python_grader_server_error"
        return _failed(name, kind, flag, f"python grader {name!r}: {outcome.error}", outcome.kind, outcome.log)
    try:
        score, _, answer = judge_grade(grader, namespaces, judge, param)
    except JudgeAnswerError as exc:
        return _failed(name, kind, "model_grader_parse_error", f"{kind} grader {name!r}: {exc}", log=exc.answer)
    return GradeResult(score, name, kind, log=answer)


def _pair(grader: dict[str, Any], namespaces: dict[str, Any], param: str) -> tuple[str, str]:
    return (render(grader["input"], namespaces, f"{param}.input"),
            render(grader["reference"], namespaces, f"{param}.reference"))


def _failed(name: str, kind: str, flag: str, message: str, error_type: str | None = None, log: str = "") -> GradeResult:
    result = GradeResult(0.0, name, kind, error=message, error_type=error_type, log=log)
    result.errors[flag] = True
    return result


def _multi(grader: dict[str, Any], namespaces: dict[str, Any], limits: SandboxLimits, judge: Judges | None,
           param: str) -> GradeResult:
    subs = {key: _one(sub, namespaces, limits, judge, f"{param}.graders.{key}") for key, sub in grader["graders"].items()}
    scores = {key: sub.score for key, sub in subs.items()}
    failed = next((sub for sub in subs.values() if not sub.ok), None)
    if failed is not None:
        flag = next(name for name, on in failed.errors.items() if on)
        result = _failed(grader["name"], "multi", flag, failed.error or "", failed.error_type, failed.log)
        result.sub_scores = scores
        return result
    where = f"{param}.calculate_output"
    try:
        score = evaluate(parse_formula(grader["calculate_output"], set(subs), where), scores, where)
    except GraderError as exc:
        result = _failed(grader["name"], "multi", "formula_parse_error", exc.message)
        result.sub_scores = scores
        return result
    return GradeResult(score, grader["name"], "multi", sub_scores=scores)
