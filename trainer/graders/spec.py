"""Grader definitions in OpenAI's JSON shapes, checked once: ``validate(grader) -> dict``.

The shapes are the ``openai`` package's ``types/graders`` (``string_check``, ``text_similarity``,
``python``, ``score_model``, ``label_model``, ``multi``). A malformed grader raises
``GraderError`` whose ``param`` is the dotted field (``grader.operation``) and whose message says
what to send instead; a valid one comes back as a plain dict with defaults filled in, which is
what ``trainer.graders.run.grade`` takes. Standard library only: the API imports it.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.graders.errors import GraderError
from trainer.graders.formula import parse_formula
from trainer.graders.template import check_template

OPERATIONS = ("eq", "ne", "like", "ilike")
SUPPORTED_METRICS = ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5",
                     "rouge_l")
REFUSED_METRICS = {
    "cosine": "needs an embedding model (OpenAI uses text-embedding-3-large), which ftq does not serve",
    "meteor": "needs WordNet synonyms and a stemmer, which ftq does not ship",
}
ROLES = ("user", "assistant", "system", "developer")
GRADER_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model", "multi")
MAX_SOURCE_CHARS = 256 * 1024
"""OpenAI's limit on a python grader's source."""
SAMPLING_KEYS = ("max_completions_tokens", "reasoning_effort", "seed", "temperature", "top_p")


def validate(grader: Any, param: str = "grader") -> dict[str, Any]:
    """The grader, checked and with its defaults; raises ``GraderError`` naming the first bad field."""
    if not isinstance(grader, dict):
        raise GraderError(f"{param}: must be an object with a 'type'", param)
    kind = grader.get("type")
    if kind not in GRADER_TYPES:
        raise GraderError(f"{param}.type: must be one of {', '.join(GRADER_TYPES)} (got {kind!r})", f"{param}.type")
    return _CHECKS[kind](grader, param)


def _fields(grader: dict[str, Any], param: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    for name in required:
        if name not in grader:
            raise GraderError(f"{param}.{name}: missing", f"{param}.{name}")
    unknown = sorted(set(grader) - set(required) - set(optional) - {"type"})
    if unknown:
        raise GraderError(f"{param}.{unknown[0]}: unknown field for a {grader['type']} grader", f"{param}.{unknown[0]}")


def _text(grader: dict[str, Any], param: str, name: str, *, template: bool = True) -> str:
    value = grader[name]
    if not isinstance(value, str):
        raise GraderError(f"{param}.{name}: must be a string (got {type(value).__name__})", f"{param}.{name}")
    if template:
        check_template(value, f"{param}.{name}")
    return value


def _name(grader: dict[str, Any], param: str) -> str:
    name = _text(grader, param, "name", template=False)
    if not name.strip():
        raise GraderError(f"{param}.name: must not be empty", f"{param}.name")
    return name


def _string_check(grader: dict[str, Any], param: str) -> dict[str, Any]:
    _fields(grader, param, ("name", "input", "reference", "operation"))
    if grader["operation"] not in OPERATIONS:
        raise GraderError(f"{param}.operation: must be one of {', '.join(OPERATIONS)} (got {grader['operation']!r})",
                          f"{param}.operation")
    return {"type": "string_check", "name": _name(grader, param), "input": _text(grader, param, "input"),
            "reference": _text(grader, param, "reference"), "operation": grader["operation"]}


def _text_similarity(grader: dict[str, Any], param: str) -> dict[str, Any]:
    _fields(grader, param, ("name", "input", "reference", "evaluation_metric"), ("pass_threshold",))
    metric = grader["evaluation_metric"]
    if isinstance(metric, str) and metric in REFUSED_METRICS:
        raise GraderError(f"{param}.evaluation_metric: {metric!r} is not supported by ftq: {REFUSED_METRICS[metric]}; "
                          f"use one of {', '.join(SUPPORTED_METRICS)}", f"{param}.evaluation_metric")
    if metric not in SUPPORTED_METRICS:
        raise GraderError(f"{param}.evaluation_metric: must be one of {', '.join(SUPPORTED_METRICS)} (got {metric!r})",
                          f"{param}.evaluation_metric")
    out = {"type": "text_similarity", "name": _name(grader, param), "input": _text(grader, param, "input"),
           "reference": _text(grader, param, "reference"), "evaluation_metric": metric}
    if "pass_threshold" in grader:
        out["pass_threshold"] = _number(grader["pass_threshold"], f"{param}.pass_threshold")
    return out


def _python(grader: dict[str, Any], param: str) -> dict[str, Any]:
    _fields(grader, param, ("name", "source"), ("image_tag", "pass_threshold"))
    source = _text(grader, param, "source", template=False)
    if len(source) > MAX_SOURCE_CHARS:
        raise GraderError(f"{param}.source: {len(source)} characters, more than {MAX_SOURCE_CHARS}", f"{param}.source")
    try:
        tree = compile(source, "<grader>", "exec", flags=0x400, dont_inherit=True)  # ast.PyCF_ONLY_AST
    except SyntaxError as exc:
        raise GraderError(f"{param}.source: does not compile: line {exc.lineno}: {exc.msg}", f"{param}.source") from None
    except ValueError as exc:  # a NUL character
        raise GraderError(f"{param}.source: does not compile: {exc}", f"{param}.source") from None
    if not any(getattr(node, "name", None) == "grade" and type(node).__name__ == "FunctionDef" for node in tree.body):
        raise GraderError(f"{param}.source: must define a top-level function grade(sample, item)", f"{param}.source")
    if grader.get("image_tag") not in (None, ""):
        raise GraderError(f"{param}.image_tag: ftq runs python graders in its own sandbox (the standard library); "
                          "leave image_tag out", f"{param}.image_tag")
    out = {"type": "python", "name": _name(grader, param), "source": source}
    if "pass_threshold" in grader:
        out["pass_threshold"] = _number(grader["pass_threshold"], f"{param}.pass_threshold")
    return out


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GraderError(f"{param}: must be a finite number (got {value!r})", param)
    return float(value)


def _messages(grader: dict[str, Any], param: str) -> list[dict[str, Any]]:
    messages = grader["input"]
    if not isinstance(messages, list) or not messages:
        raise GraderError(f"{param}.input: must be a non-empty list of messages", f"{param}.input")
    out = []
    for i, message in enumerate(messages):
        where = f"{param}.input[{i}]"
        if not isinstance(message, dict):
            raise GraderError(f"{where}: must be an object with 'role' and 'content'", where)
        unknown = sorted(set(message) - {"role", "content", "type"})
        if unknown:
            raise GraderError(f"{where}.{unknown[0]}: unknown field of a message", f"{where}.{unknown[0]}")
        if message.get("role") not in ROLES:
            raise GraderError(f"{where}.role: must be one of {', '.join(ROLES)} (got {message.get('role')!r})",
                              f"{where}.role")
        if message.get("type", "message") != "message":
            raise GraderError(f"{where}.type: must be 'message'", f"{where}.type")
        out.append({"role": message["role"], "content": _content(message.get("content"), f"{where}.content")})
    return out


def _content(content: Any, param: str) -> str:
    """A message's content as one text: a string, or text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        check_template(content, param)
        return content
    parts = content if isinstance(content, list) else [content]
    texts = []
    for i, part in enumerate(parts):
        where = f"{param}[{i}]" if isinstance(content, list) else param
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise GraderError(f"{where}: only text content is supported (a string, input_text or output_text; "
                              f"got {kind!r})", where)
        check_template(texts[-1], where)
    return "".join(texts)


def _sampling(grader: dict[str, Any], param: str) -> dict[str, Any]:
    params = grader.get("sampling_params") or {}
    where = f"{param}.sampling_params"
    if not isinstance(params, dict):
        raise GraderError(f"{where}: must be an object", where)
    unknown = sorted(set(params) - set(SAMPLING_KEYS))
    if unknown:
        raise GraderError(f"{where}.{unknown[0]}: unknown; one of {', '.join(SAMPLING_KEYS)}", f"{where}.{unknown[0]}")
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        if params.get(key) is not None:
            out[key] = _number(params[key], f"{where}.{key}")
    if out.get("temperature", 0.0) < 0 or not 0 < out.get("top_p", 1.0) <= 1:
        bad = "temperature" if out.get("temperature", 0.0) < 0 else "top_p"
        raise GraderError(f"{where}.{bad}: out of range (temperature >= 0, 0 < top_p <= 1)", f"{where}.{bad}")
    for key, low in (("max_completions_tokens", 1), ("seed", 0)):
        value = params.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise GraderError(f"{where}.{key}: must be an integer >= {low} (got {value!r})", f"{where}.{key}")
            out[key] = value
    return out


def _model_common(grader: dict[str, Any], param: str) -> dict[str, Any]:
    model = _text(grader, param, "model", template=False)
    if not model.strip():
        raise GraderError(f"{param}.model: must name a model", f"{param}.model")
    return {"name": _name(grader, param), "model": model, "input": _messages(grader, param)}


def _score_model(grader: dict[str, Any], param: str) -> dict[str, Any]:
    _fields(grader, param, ("name", "model", "input"), ("range", "sampling_params", "pass_threshold"))
    out = {"type": "score_model", **_model_common(grader, param), "sampling_params": _sampling(grader, param)}
    score_range = grader.get("range") or [0, 1]
    if not isinstance(score_range, list) or len(score_range) != 2:
        raise GraderError(f"{param}.range: must be two numbers [low, high]", f"{param}.range")
    low, high = (_number(v, f"{param}.range") for v in score_range)
    if low >= high:
        raise GraderError(f"{param}.range: low must be below high (got {score_range})", f"{param}.range")
    out["range"] = [low, high]
    if "pass_threshold" in grader:
        out["pass_threshold"] = _number(grader["pass_threshold"], f"{param}.pass_threshold")
    return out


def _label_model(grader: dict[str, Any], param: str) -> dict[str, Any]:
    _fields(grader, param, ("name", "model", "input", "labels", "passing_labels"), ("sampling_params",))
    out = {"type": "label_model", **_model_common(grader, param), "sampling_params": _sampling(grader, param)}
    for key in ("labels", "passing_labels"):
        values = grader[key]
        if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
            raise GraderError(f"{param}.{key}: must be a non-empty list of non-empty strings", f"{param}.{key}")
        out[key] = list(values)
    stray = [label for label in out["passing_labels"] if label not in out["labels"]]
    if stray:
        raise GraderError(f"{param}.passing_labels: {stray[0]!r} is not one of labels", f"{param}.passing_labels")
    return out


def _multi(grader: dict[str, Any], param: str) -> dict[str, Any]:
    """``graders`` is a map of name to grader, as OpenAI's guide writes it; the client's type also
    allows one grader, which is then known by its own ``name``."""
    _fields(grader, param, ("name", "graders", "calculate_output"), ("pass_threshold",))
    inner = grader["graders"]
    if isinstance(inner, dict) and "type" in inner and not isinstance(inner.get("type"), dict):
        inner = {inner["name"] if isinstance(inner.get("name"), str) else "grader": inner}
    if not isinstance(inner, dict) or not inner:
        raise GraderError(f"{param}.graders: must be an object mapping names to graders", f"{param}.graders")
    graders = {}
    for key, sub in inner.items():
        if not key.isidentifier():
            raise GraderError(f"{param}.graders.{key}: a name the formula can use (letters, digits, _)",
                              f"{param}.graders.{key}")
        if isinstance(sub, dict) and sub.get("type") == "multi":
            raise GraderError(f"{param}.graders.{key}.type: a multi grader cannot nest another", f"{param}.graders.{key}.type")
        graders[key] = validate(sub, f"{param}.graders.{key}")
    formula = _text(grader, param, "calculate_output", template=False)
    parse_formula(formula, set(graders), f"{param}.calculate_output")
    out = {"type": "multi", "name": _name(grader, param), "graders": graders, "calculate_output": formula}
    if "pass_threshold" in grader:
        out["pass_threshold"] = _number(grader["pass_threshold"], f"{param}.pass_threshold")
    return out


_CHECKS = {"string_check": _string_check, "text_similarity": _text_similarity, "python": _python,
           "score_model": _score_model, "label_model": _label_model, "multi": _multi}
