"""``python -m trainer eval job.json``: an eval run (``EvalConfig``) as a process.

The generation job's runner (``trainer.generate.job.run_generation``: ranks, chunks, the
resumable output, cancel) with one change: each finished prompt is graded by every testing
criterion (``trainer.evals.results.grade_all``) before its line is written, so a resumed run
starts at the first item with no line and never grades an item twice. A line is the generation
line plus the item (``item``), the grades (``results``) and the item's ``status``.
"""

from __future__ import annotations

from typing import Any

from trainer.evals.config import EvalConfig
from trainer.evals.results import grade_all, status_of
from trainer.generate.job import Emit, output_line, run_generation
from trainer.generate.params import Result
from trainer.generate.prompts import PromptRecord
from trainer.graders import SandboxLimits
from trainer.parallel.distributed import World


def run_eval(config: EvalConfig, emit: Emit, world: World | None = None) -> str:
    """Generate and grade every item; ``succeeded`` or ``cancelled`` (failures raise, as generation's).
    An lm-eval task's run (``config.lm_eval``) is ``trainer.evals.lm_run``'s."""
    if config.lm_eval is not None:
        from trainer.evals.lm_run import run_lm_eval

        return run_lm_eval(config, emit, world)
    limits = SandboxLimits(**config.sandbox) if config.sandbox else SandboxLimits()

    def graded(prompt: PromptRecord, result: Result) -> dict[str, Any]:
        return graded_line(output_line(prompt, result), prompt.record.get("item"), config.testing_criteria, limits)

    return run_generation(config, emit, world, line_of=graded)


def graded_line(line: dict[str, Any], item: Any, criteria: list[dict[str, Any]],
                limits: SandboxLimits) -> dict[str, Any]:
    """``line`` (a completions.jsonl line) with the ``item`` it was rendered from and its grades:
    each criterion grades the first choice's text."""
    text = line["choices"][0]["text"] if line["choices"] else ""
    results = grade_all(criteria, text, item, limits=limits)
    return {**line, "item": item, "results": results, "status": status_of(results)}
