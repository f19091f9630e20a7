"""The stored spec of a job of kind ``eval``: one eval run (``core.evals.runs`` builds it).

An eval run is a generation job (``GenerateSpec``: its model, a prompts file, sampling, chunks,
GPUs, priority and project, checked and placed as one) whose prompts file the run's creation
rendered from the items (each line ``{"messages": [...], "item": {...}}``) and whose every
completion is graded by the eval's ``testing_criteria`` before its line is written
(``trainer.evals``). Nobody posts this body: ``POST /v1/evals/{id}/runs`` and
``/openai/v1/evals/{id}/runs`` make it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from core.jobs.generate_spec import GenerateSpec

KIND = "eval"


class EvalJobSpec(GenerateSpec):
    """An eval run as a queued job."""

    kind: Annotated[Literal["eval"], Field(description="eval: an eval run (generate, then grade).")]  # type: ignore[assignment]
    eval_id: Annotated[str, Field(min_length=1, max_length=64, description="The eval this run belongs to.")]
    run_id: Annotated[str, Field(min_length=1, max_length=64, description="The run (evalrun_...).")]
    testing_criteria: Annotated[list[dict[str, Any]], Field(
        min_length=1, description="The eval's graders as validated at its creation, each with its pass_threshold "
        "(an lm_eval run: its task's metrics, type lm_eval).")]
    lm_eval: Annotated[dict[str, Any] | None, Field(
        description="An lm_eval run's task (core.evals.lm_task.check_task): the worker runs it over the "
        "prompts file's items with lm-evaluation-harness instead of generating and grading.")] = None


def is_eval(raw: object) -> bool:
    """Whether a stored spec is an eval run's."""
    return isinstance(raw, dict) and raw.get("kind") == KIND
