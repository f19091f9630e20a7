"""``score_model`` and ``label_model``: a model on this box judges the output.

A judge is any callable ``judge(messages, params) -> str``: OpenAI-style chat messages in, the
model's text out. ``engine_judge`` builds one over the trainer's sampler
(``trainer.generate.Engine`` and the tokenizer's chat template); evals and GRPO pass theirs. Where
criteria name several judge models, pass a mapping of each grader's ``model`` to its judge
(``Judges``; an eval run's: ``trainer.evals.judges``).

OpenAI runs these graders with structured outputs, the answer an object whose ``result`` is the
score (``score_model``) or the label (``label_model``). A model on this box has no schema-bound
decoding, so ftq states the same contract in a system message ahead of the grader's own
(``answer_instruction``) and reads the answer: the first JSON object in it that has a ``result``,
else the whole answer as a bare number or label. A score outside ``range`` or a label not in
``labels`` is a parse error for that item, as OpenAI's ``model_grader_parse_error``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.graders.errors import GraderError
from trainer.graders.template import render


@dataclass(frozen=True)
class JudgeParams:
    """A grader's ``sampling_params`` in the sampler's terms (greedy when no temperature is given)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @classmethod
    def of(cls, sampling: dict[str, Any]) -> JudgeParams:
        return cls(max_tokens=sampling.get("max_completions_tokens", 256), temperature=sampling.get("temperature", 0.0),
                   top_p=sampling.get("top_p", 1.0), seed=sampling.get("seed"))


Judge = Callable[[list[dict[str, str]], JudgeParams], str]
Judges = Judge | Mapping[str, Judge]
"""One judge for every model grader, or one per grader ``model``."""


class JudgeAnswerError(ValueError):
    """The judge answered, but not with a score or label ftq can read."""

    answer = ""
    """What the judge said (set by ``judge_grade``)."""


def answer_instruction(grader: dict[str, Any]) -> str:
    if grader["type"] == "score_model":
        low, high = grader["range"]
        return (f'Answer with a JSON object {{"result": <score>}} where <score> is a number from {low:g} to {high:g}, '
                "and nothing else.")
    labels = ", ".join(json.dumps(label) for label in grader["labels"])
    return f'Answer with a JSON object {{"result": <label>}} where <label> is one of {labels}, and nothing else.'


def judge_messages(grader: dict[str, Any], namespaces: dict[str, Any], param: str) -> list[dict[str, str]]:
    """The grader's messages rendered, ``developer`` as ``system``, the answer contract first."""
    messages = [{"role": "system" if m["role"] == "developer" else m["role"],
                 "content": render(m["content"], namespaces, f"{param}.input[{i}].content")}
                for i, m in enumerate(grader["input"])]
    return [{"role": "system", "content": answer_instruction(grader)}, *messages]


def read_answer(grader: dict[str, Any], answer: str) -> tuple[float, Any]:
    """(score, what the judge said): the score, or 1/0 for a passing/failing label."""
    result = _result(answer)
    if grader["type"] == "score_model":
        low, high = grader["range"]
        try:
            score = float(result)
        except (TypeError, ValueError):
            raise JudgeAnswerError(f"the judge's answer is not a score: {answer[:200]!r}") from None
        if not low <= score <= high:
            raise JudgeAnswerError(f"the judge's score {score:g} is outside range [{low:g}, {high:g}]")
        return score, score
    if not isinstance(result, str) or result.strip() not in grader["labels"]:
        raise JudgeAnswerError(f"the judge's answer is not one of the labels {grader['labels']}: {answer[:200]!r}")
    label = result.strip()
    return float(label in grader["passing_labels"]), label


def _result(answer: str) -> Any:
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"\{", answer)):
        try:
            value, _ = decoder.raw_decode(answer, start)
        except ValueError:
            continue
        if isinstance(value, dict) and "result" in value:
            return value["result"]
    return answer.strip().strip('"')


def judge_grade(grader: dict[str, Any], namespaces: dict[str, Any], judges: Judges | None,
                param: str) -> tuple[float, Any, str]:
    """(score, the judge's verdict, its raw answer); raises ``JudgeAnswerError`` for an unreadable one.
    ``judges``: a judge, or a mapping picking one by the grader's ``model``."""
    messages = judge_messages(grader, namespaces, param)
    judge = judges.get(grader["model"]) if isinstance(judges, Mapping) else judges
    if judge is None:
        raise GraderError(f"{param}: a {grader['type']} grader needs a judge model; it runs inside eval runs and "
                          "training on a worker's GPU, not here", f"{param}.type")
    answer = judge(messages, JudgeParams.of(grader["sampling_params"]))
    try:
        score, verdict = read_answer(grader, answer)
    except JudgeAnswerError as exc:
        exc.answer = answer
        raise
    return score, verdict, answer


def engine_judge(engine: Any, tokenizer: Any) -> Judge:
    """A judge over the trainer's sampler: the messages through the tokenizer's chat template,
    one completion. Imports torch (through ``trainer.generate``) when built, not before."""
    from trainer.generate.chat import render_messages
    from trainer.generate.params import Request, SamplingParams

    def judge(messages: list[dict[str, str]], params: JudgeParams) -> str:
        prompt = render_messages(tokenizer, messages)
        sampling = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  seed=params.seed)
        [result] = engine.generate([Request(tuple(prompt), sampling)])
        return result.completions[0].text

    return judge
