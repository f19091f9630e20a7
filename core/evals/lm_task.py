"""An lm-evaluation-harness task as an eval run's ``data_source`` (``type: lm_eval``), checked
without ``lm_eval`` (the API need not have the extra; the worker runs it: ``trainer.evals.lm_run``).

``data_source.task`` is the task's YAML as a JSON object, minus where its documents come from:
they are the run's items (``data_source.source``, as for a ``completions`` run), so nothing is
downloaded at run time and every run is resumable item by item. What is taken:

- ``task`` (its name), ``output_type``: ``generate_until``, ``loglikelihood`` or ``multiple_choice``;
- ``doc_to_text``, ``doc_to_target``, ``doc_to_choice`` (multiple_choice), ``description``,
  ``target_delimiter``, ``fewshot_delimiter``: lm-eval's templates (a field name or Jinja);
- ``generation_kwargs`` (generate_until): ``until``, ``max_gen_toks``, ``do_sample``, ``temperature``;
- ``metric_list``: metrics lm-eval scores per document and averages (``aggregation: mean``) from
  ``METRICS``, each with ftq's optional ``pass_threshold`` (default 1: the document scored 1);
- ``filter_list`` (generate_until): lm-eval's built-in ``FILTERS``; ``num_fewshot``: 0; ``metadata``.

Refused with a 400 naming the field: ``dataset_path`` and the other dataset keys (the items are the
data), another output type (``loglikelihood_rolling``: its perplexities are corpus aggregates), a
metric that lm-eval would fetch from the hub (any name outside ``METRICS``) or that is not a mean
(bleu, perplexity, f1, ...), ``process_docs``/``process_results`` (code), few-shot examples, and a
template string with ``__`` (a first filter only: a template can build a dunder at render time; the
boundary is the worker rendering every template in Jinja's sandbox, ``trainer.evals.lm_run.sandbox_templates``).
"""

from __future__ import annotations

import re
from typing import Any

from core.errors import InvalidInput

OUTPUT_TYPES = ("generate_until", "loglikelihood", "multiple_choice")
METRICS = {"generate_until": ("exact_match",), "loglikelihood": ("acc",),
           "multiple_choice": ("acc", "acc_norm", "acc_bytes")}
"""Per output type, the built-in metrics lm-eval scores per document and aggregates by mean."""
FILTERS = ("regex", "take_first", "remove_whitespace", "lowercase", "uppercase")
TEMPLATES = ("doc_to_text", "doc_to_target", "doc_to_choice", "description", "target_delimiter", "fewshot_delimiter")
GENERATION = {"until": (str, list), "max_gen_toks": (int,), "do_sample": (bool,), "temperature": (int, float)}
TAKEN = {"task", "output_type", "generation_kwargs", "metric_list", "filter_list", "num_fewshot", "metadata", *TEMPLATES}
DATASET = ("dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset", "training_split", "validation_split",
           "test_split", "fewshot_split", "process_docs")
MAX_GEN_TOKS = 4096
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _fail(param: str, message: str) -> InvalidInput:
    return InvalidInput(f"{param}: {message}", param=param)


def check_task(task: Any, param: str = "data_source.task") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(task config, criteria)``: the task as the worker writes its YAML (the dataset keys are
    the worker's), and one criterion per metric (``{"name", "type": "lm_eval", "pass_threshold"}``),
    what the run's results count by."""
    if not isinstance(task, dict):
        raise _fail(param, "the lm-eval task's YAML as an object, e.g. {\"task\": \"my_qa\", \"output_type\": "
                    "\"generate_until\", \"doc_to_text\": \"Q: {{question}}\\nA:\", \"doc_to_target\": \"{{answer}}\"}")
    for key in task:
        if key in DATASET:
            raise _fail(f"{param}.{key}", "the task's documents are the run's items (data_source.source): leave "
                        "the dataset keys out (nothing is downloaded)")
        if key not in TAKEN:
            raise _fail(f"{param}.{key}", f"not supported in an lm_eval run; the task may set {', '.join(sorted(TAKEN))}")
    name, kind = task.get("task"), task.get("output_type")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _fail(f"{param}.task", "the task's name: 1 to 64 letters, digits, '_', '.', '-'")
    if kind not in OUTPUT_TYPES:
        raise _fail(f"{param}.output_type", f"one of {', '.join(OUTPUT_TYPES)}, got {kind!r}")
    _check_templates(task, kind, param)
    if task.get("num_fewshot", 0) not in (0, None):
        raise _fail(f"{param}.num_fewshot", "0: few-shot examples are not supported (put examples in doc_to_text)")
    if task.get("metadata") is not None and not isinstance(task["metadata"], dict):
        raise _fail(f"{param}.metadata", "an object")
    if "generation_kwargs" in task or "filter_list" in task:
        if kind != "generate_until":
            key = "generation_kwargs" if "generation_kwargs" in task else "filter_list"
            raise _fail(f"{param}.{key}", "only a generate_until task generates")
    _check_generation(task.get("generation_kwargs"), f"{param}.generation_kwargs")
    _check_filters(task.get("filter_list"), f"{param}.filter_list")
    criteria = _check_metrics(task.get("metric_list"), kind, f"{param}.metric_list")
    config = {k: v for k, v in task.items() if k != "metric_list"}
    config["metric_list"] = [{"metric": c["name"], "aggregation": "mean", "higher_is_better": True} for c in criteria]
    return config, criteria


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def _check_templates(task: dict[str, Any], kind: str, param: str) -> None:
    for key in ("doc_to_text", "doc_to_target"):
        if key not in task:
            raise _fail(f"{param}.{key}", "missing (a field name or a Jinja template over the item)")
    if kind == "multiple_choice" and "doc_to_choice" not in task:
        raise _fail(f"{param}.doc_to_choice", "a multiple_choice task names its choices (a list, a field, a template)")
    for key in TEMPLATES:
        if key not in task:
            continue
        value = task[key]
        ok = isinstance(value, str) or (key == "doc_to_target" and isinstance(value, int) and not isinstance(value, bool)) \
            or (key == "doc_to_choice" and isinstance(value, list) and all(isinstance(v, str) for v in value))
        if not ok:
            raise _fail(f"{param}.{key}", "a string (doc_to_target may be an index, doc_to_choice a list of strings)")
    for key, value in task.items():
        if any("__" in s for s in _strings(value)):
            raise _fail(f"{param}.{key}", "'__' is refused in a task's strings (templates may not reach Python's internals)")


def _check_generation(kwargs: Any, param: str) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise _fail(param, "an object")
    for key, value in kwargs.items():
        if key not in GENERATION:
            raise _fail(f"{param}.{key}", f"unknown; ftq's sampler takes {', '.join(GENERATION)}")
        if isinstance(value, bool) and key != "do_sample" or not isinstance(value, GENERATION[key]):
            raise _fail(f"{param}.{key}", "wrong type")
    until = kwargs.get("until", [])
    if isinstance(until, list) and not all(isinstance(u, str) and u for u in until):
        raise _fail(f"{param}.until", "a string or a list of non-empty strings")
    if not 1 <= int(kwargs.get("max_gen_toks", 256)) <= MAX_GEN_TOKS:
        raise _fail(f"{param}.max_gen_toks", f"1 to {MAX_GEN_TOKS}")
    if not 0 <= float(kwargs.get("temperature", 1.0)) <= 2:
        raise _fail(f"{param}.temperature", "0 to 2")


def _check_filters(filters: Any, param: str) -> None:
    if filters is None:
        return
    if not isinstance(filters, list) or len(filters) != 1:
        raise _fail(param, "one filter pipeline ({\"name\", \"filter\": [{\"function\": ...}, ...]}): its output is "
                    "what the metrics score")
    pipeline = filters[0]
    if not isinstance(pipeline, dict) or not isinstance(pipeline.get("filter"), list) or set(pipeline) - {"name", "filter"}:
        raise _fail(f"{param}[0]", "{\"name\": ..., \"filter\": [{\"function\": ...}, ...]}")
    for i, step in enumerate(pipeline["filter"]):
        if not isinstance(step, dict) or step.get("function") not in FILTERS:
            raise _fail(f"{param}[0].filter[{i}].function", f"one of lm-eval's {', '.join(FILTERS)}")


def _check_metrics(metrics: Any, kind: str, param: str) -> list[dict[str, Any]]:
    allowed = METRICS[kind]
    if metrics is None:
        return [{"name": allowed[0], "type": "lm_eval", "pass_threshold": 1.0}]
    if not isinstance(metrics, list) or not metrics:
        raise _fail(param, "a non-empty list of {\"metric\": ...}")
    criteria: list[dict[str, Any]] = []
    for i, entry in enumerate(metrics):
        where = f"{param}[{i}]"
        if not isinstance(entry, dict) or entry.get("metric") not in allowed:
            got = entry.get("metric") if isinstance(entry, dict) else entry
            raise _fail(f"{where}.metric", f"a {kind} task's metrics here are {', '.join(allowed)} (scored per item, "
                        f"averaged; others are corpus-level or fetched from the hub), got {got!r}")
        unknown = sorted(set(entry) - {"metric", "aggregation", "higher_is_better", "pass_threshold"})
        if unknown:
            raise _fail(f"{where}.{unknown[0]}", "unknown field")
        if entry.get("aggregation", "mean") != "mean":
            raise _fail(f"{where}.aggregation", "mean: ftq reports each item's score and their mean")
        threshold = entry.get("pass_threshold", 1.0)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise _fail(f"{where}.pass_threshold", "a number")
        if entry["metric"] in [c["name"] for c in criteria]:
            raise _fail(f"{where}.metric", "named twice")
        criteria.append({"name": entry["metric"], "type": "lm_eval", "pass_threshold": float(threshold)})
    return criteria


def check_data_source(source: dict[str, Any]) -> None:
    """An ``lm_eval`` data source: ``type``, ``model``, ``source`` (the items) and ``task``, nothing else
    (the task's ``generation_kwargs`` are its sampling)."""
    unknown = sorted(set(source) - {"type", "model", "source", "task"})
    if unknown:
        raise _fail(f"data_source.{unknown[0]}", "not taken by an lm_eval run (data_source: type, model, source, "
                    "task; sampling is the task's generation_kwargs)")
    check_task(source.get("task"))


def sampling(task: dict[str, Any]) -> dict[str, Any]:
    """The job's ``sampling`` (what the submission checks each prompt's room against): a generate_until
    task's ``max_gen_toks`` (lm-eval's default 256), one token for the likelihood tasks."""
    if task["output_type"] != "generate_until":
        return {"max_tokens": 1, "temperature": 0.0}
    kwargs = task.get("generation_kwargs") or {}
    temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
    return {"max_tokens": int(kwargs.get("max_gen_toks", 256)), "temperature": temperature}
