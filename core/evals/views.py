"""Evals, runs and output items in OpenAI's shapes (the ``openai`` package's ``types/evals``), the
run's results read from its job's graded lines (``completions.jsonl``, or its parts while it
runs: ``trainer.generate.outputs``) and counted by ``trainer.evals.results.summarize``."""

from __future__ import annotations

import datetime as dt
from typing import Any

from core.errors import InvalidInput, NotFound
from core.evals.models import Eval, EvalRun
from core.evals.service import page
from core.jobs import artifact_store
from core.jobs.models import Job
from core.settings import Settings
from trainer.evals.results import summarize
from trainer.generate import outputs
from trainer.generate.job_config import COMPLETIONS, PARTS

SAMPLE_SCHEMA = {"type": "object", "properties": {
    "model": {"type": "string"}, "choices": {"type": "array"}, "output_text": {"type": "string"},
    "output_json": {"type": "object"}, "output_tools": {"type": "array"}}, "required": ["output_text"]}
"""The ``sample`` namespace a grader reads (``trainer.graders.template.sample_namespace``)."""
ITEM_STATUSES = ("pass", "fail", "error")
STATUSES = {"queued": "queued", "running": "in_progress", "succeeded": "completed", "failed": "failed",
            "cancelled": "canceled"}
"""A run's status (OpenAI's words) from its job's."""


def _unix(when: dt.datetime | None) -> int | None:
    return int(when.timestamp()) if when is not None else None


def eval_object(row: Eval) -> dict[str, Any]:
    """OpenAI's ``Eval``: the custom data source config as its full schema, the criteria as stored."""
    properties: dict[str, Any] = {"item": row.item_schema}
    if row.include_sample_schema:
        properties["sample"] = SAMPLE_SCHEMA
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"object": "eval", "id": row.eval_id, "name": row.name, "created_at": _unix(row.created_at),
            "metadata": row.user_metadata, "data_source_config": {"type": "custom", "schema": schema},
            "testing_criteria": row.testing_criteria}


def graded_lines(job: Job, settings: Settings) -> list[dict[str, Any]]:
    """The run's graded lines written so far, in item order, read from its job's artifact store
    (a remote worker uploads them there: worker/remote_generation.py)."""
    directory = artifact_store.job_store_dir(settings, job.job_id)
    done = outputs.read_lines(directory / COMPLETIONS, directory / PARTS)
    return [done[i] for i in sorted(done)]


def run_object(run: EvalRun, job: Job, criteria: list[dict[str, Any]], settings: Settings,
               lines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """OpenAI's ``eval.run``; results count the lines graded so far (all of them once completed)."""
    totals = summarize(graded_lines(job, settings) if lines is None else lines, criteria)
    usage = totals["usage"]
    error = {"code": job.error_code or "failed", "message": job.error_message or ""} if job.status == "failed" else None
    return {
        "object": "eval.run", "id": run.run_id, "eval_id": run.eval_id, "name": run.name, "model": run.model,
        "status": STATUSES[job.status], "created_at": _unix(run.created_at), "metadata": run.user_metadata,
        "data_source": run.data_source, "error": error, "report_url": f"/#/jobs/{job.job_id}",
        "result_counts": totals["result_counts"],
        "per_testing_criteria_results": totals["per_testing_criteria_results"],
        "per_model_usage": [{"model_name": run.model, "invocation_count": usage["invocation_count"],
                             "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                             "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                             "cached_tokens": 0}] if usage["invocation_count"] else [],
        "job_id": job.job_id,
    }


def output_item_id(run_id: str, index: int) -> str:
    return f"outputitem_{run_id.removeprefix('evalrun_')}_{index}"


def output_item(run: EvalRun, line: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``eval.run.output_item`` of one graded line."""
    choice = line["choices"][0] if line.get("choices") else {}
    usage = line.get("usage", {})
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    sample = {
        "input": line.get("messages", []), "output": [{"role": "assistant", "content": choice.get("text", "")}],
        "finish_reason": choice.get("finish_reason", ""), "model": run.model, "error": None,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "cached_tokens": 0},
        "temperature": sampling.get("temperature", 1.0), "max_completion_tokens": sampling.get("max_tokens", 256),
        "top_p": sampling.get("top_p", 1.0), "seed": sampling.get("seed"),
    }
    return {"object": "eval.run.output_item", "id": output_item_id(run.run_id, line["index"]),
            "eval_id": run.eval_id, "run_id": run.run_id, "created_at": _unix(run.created_at),
            "status": line["status"], "datasource_item_id": line["index"], "datasource_item": line.get("item") or {},
            "results": line["results"], "sample": sample}


def output_items(run: EvalRun, job: Job, settings: Settings, *, status: str | None = None, order: str = "asc",
                 after: str | None = None, limit: int = 20) -> tuple[list[dict[str, Any]], bool]:
    """A page of the run's output items (``status``: pass, fail or error)."""
    if status is not None and status not in ITEM_STATUSES:
        raise InvalidInput(f"status: one of {', '.join(ITEM_STATUSES)}", param="status")
    lines = [line for line in graded_lines(job, settings) if status is None or line["status"] == status]
    rows, more = page(lines, lambda line: output_item_id(run.run_id, line["index"]), order=order, after=after,
                      limit=limit, what="output item")
    sampling = job.spec.get("sampling", {})
    return [output_item(run, line, sampling) for line in rows], more


def one_output_item(run: EvalRun, job: Job, item_id: str, settings: Settings) -> dict[str, Any]:
    """One output item by id; NotFound when the run has not graded it (yet)."""
    for line in graded_lines(job, settings):
        if output_item_id(run.run_id, line["index"]) == item_id:
            return output_item(run, line, job.spec.get("sampling", {}))
    raise NotFound(f"No such output item: {item_id!r} of run {run.run_id}", param="output_item_id")
