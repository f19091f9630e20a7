"""``python -m trainer eval job.json``: an eval run (``EvalConfig``) as a process.

The generation job's runner (``trainer.generate.job.run_generation``: ranks, chunks, the
resumable output, cancel) with one change: each finished prompt is graded by every testing
criterion (``trainer.evals.results.grade_all``) before its line is written, so a resumed run
starts at the first item with no line and never grades an item twice. With a python grader the
chunk's items are graded on ``grading_workers`` threads (one sandboxed process each) while the
next chunk generates, so the GPU does not wait for the graders (``bench.evals`` measured 51 s of
grading against 22 s of generation for 1,000 items on the 8B shape when they ran in turn). A line is the generation
line plus the item (``item``), the grades (``results``) and the item's ``status``.

A ``score_model`` or ``label_model`` criterion (also inside a ``multi``) is judged by the model its
``model`` names (``trainer.evals.judges``: loaded once the run's model has, or that model itself).
Such a run grades in line, on the runner's thread, whatever ``grading_workers`` says: the judge is
an ``Engine`` on the same GPU (often on the same modules) as the run's, and engines are not
thread-safe, so a judge call must not overlap the next chunk's generation.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from trainer.evals.config import EvalConfig
from trainer.evals.judges import load_judges
from trainer.evals.results import grade_all, status_of
from trainer.generate.job import Emit, LineOf, _silent, output_line, run_generation
from trainer.generate.params import Result
from trainer.generate.prompts import PromptRecord
from trainer.graders import SandboxLimits, uses_model
from trainer.graders.judge import Judges
from trainer.parallel.distributed import World


def run_eval(config: EvalConfig, emit: Emit, world: World | None = None) -> str:
    """Generate and grade every item; ``succeeded`` or ``cancelled`` (failures raise, as generation's).
    An lm-eval task's run (``config.lm_eval``) is ``trainer.evals.lm_run``'s."""
    if config.lm_eval is not None:
        from trainer.evals.lm_run import run_lm_eval

        return run_lm_eval(config, emit, world)
    limits = SandboxLimits(**config.sandbox) if config.sandbox else SandboxLimits()
    log = emit if (world or World.from_env()).is_main else _silent

    def lines_for(model: Any, tokenizer: Any, device: torch.device) -> LineOf:
        judges = load_judges(config, model, tokenizer, device, log) if config.judges else None

        def graded(prompt: PromptRecord, result: Result) -> dict[str, Any]:
            return graded_line(output_line(prompt, result), prompt.record.get("item"), config.testing_criteria,
                               limits, judges)

        return graded

    return run_generation(config, emit, world, lines_for=lines_for, lines_workers=grading_workers(config))


GRADING_WORKERS = 8
"""Most python graders run at once by default (each its own sandboxed process)."""


def grading_workers(config: EvalConfig) -> int:
    """``config.grading_workers``, or the default it documents; 0 where a criterion uses a judge
    model (its engine runs on the runner's thread only: see the module docstring)."""
    if any(uses_model(c) for c in config.testing_criteria):
        return 0
    if config.grading_workers is not None:
        return config.grading_workers
    if not any(runs_python(c) for c in config.testing_criteria):
        return 0
    return max(1, min(GRADING_WORKERS, os.cpu_count() or 1))


def runs_python(grader: dict[str, Any]) -> bool:
    """Whether a grader (or one inside a multi grader) runs the user's python in a process."""
    if grader["type"] == "multi":
        return any(runs_python(sub) for sub in grader["graders"].values())
    return grader["type"] == "python"


def graded_line(line: dict[str, Any], item: Any, criteria: list[dict[str, Any]],
                limits: SandboxLimits, judges: Judges | None = None) -> dict[str, Any]:
    """``line`` (a completions.jsonl line) with the ``item`` it was rendered from and its grades:
    each criterion grades the first choice's text (a model grader with its ``model``'s judge)."""
    text = line["choices"][0]["text"] if line["choices"] else ""
    results = grade_all(criteria, text, item, limits=limits, judge=judges)
    return {**line, "item": item, "results": results, "status": status_of(results)}
