"""Graders for the service: check one, or run one on a sample (``graders.validate`` / ``graders.run``).

The graders themselves are ``trainer.graders`` (standard library; the trainer grades with the
same code); this module maps their errors to ``InvalidInput`` naming the field, takes the
python sandbox's limits from the settings, and keeps ``score_model`` / ``label_model`` out of the
API process, which has no model to judge with.
"""

from __future__ import annotations

from typing import Any

from core.errors import InvalidInput
from core.settings import Settings
from trainer.graders import GradeResult, GraderError, SandboxLimits, grade, uses_model, validate


def check(grader: Any) -> dict[str, Any]:
    """The grader validated, its defaults filled in; ``InvalidInput`` names the first bad field."""
    try:
        return validate(grader)
    except GraderError as exc:
        raise InvalidInput(exc.message, param=exc.param) from None


def limits_of(settings: Settings) -> SandboxLimits:
    return SandboxLimits(cpu_s=settings.grader_cpu_s, wall_s=settings.grader_wall_s,
                         memory_bytes=settings.grader_memory_mib << 20)


def run(grader: Any, model_sample: str, item: Any, settings: Settings) -> tuple[dict[str, Any], GradeResult]:
    """The grader checked, then its result on one sample. Blocking (a python grader's process):
    call it from a worker thread.

    Raises:
        InvalidInput: a malformed grader; a template naming a field the item or sample lacks; a
            model grader (``score_model``, ``label_model``), which needs a judge model loaded on a GPU.
    """
    checked = check(grader)
    if uses_model(checked):
        raise InvalidInput(
            "grader.type: score_model and label_model graders need a judge model loaded on a GPU worker, so "
            "graders.run does not run them in the API; graders.validate checks them, and an eval run judges with "
            "the model they name, through the trainer's sampler (docs/evals.md)", param="grader.type")
    try:
        return checked, grade(checked, model_sample, item, limits=limits_of(settings))
    except GraderError as exc:
        raise InvalidInput(exc.message, param=exc.param) from None
