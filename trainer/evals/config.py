"""What ``python -m trainer eval job.json`` reads: an eval run (standard library only, as
``trainer.generate.job_config``, so the worker builds it without torch).

An eval run is a generation job (``GenerateConfig``: the model, the prompts, sampling, chunks,
the resumable output) plus the eval's ``testing_criteria``: each prompt's line carries the
item it was rendered from (``item``), and its completion is graded by every criterion before
the line is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainer.generate.job_config import GenerateConfig

KIND = "eval"
"""``kind`` of an eval run's job.json."""
JUDGE_FIELDS = ("model", "adapter", "tokenizer")
"""What ``EvalConfig.judges`` gives of each judge: ``GenerateConfig``'s fields of the same names."""


@dataclass(frozen=True)
class EvalConfig(GenerateConfig):
    """One eval run: generate, then grade each completion."""

    testing_criteria: list[dict[str, Any]] = field(default_factory=list)
    """The eval's graders, as ``trainer.graders.validate`` returned them (with ``pass_threshold``)."""
    sandbox: dict[str, float] = field(default_factory=dict)
    """A python grader's limits: ``trainer.graders.SandboxLimits`` fields (the box's settings)."""
    grading_workers: int | None = None
    """Completions graded at once, while the next chunk generates (``trainer.generate.job.ChunkLines``).
    None: up to ``GRADING_WORKERS`` (the box's cores) when a criterion runs a python grader (a
    process per item, which would leave the GPU idle), else 0 (graded in line: the in-process
    graders take microseconds and would only compete with the sampler's host thread)."""
    judges: dict[str, dict[str, str | None]] = field(default_factory=dict)
    """The judge of each model grader's ``model`` (``score_model``, ``label_model``, also inside a
    ``multi``): ``{"model": directory or hub id, "adapter": directory or None, "tokenizer": directory
    or None}``, as the worker resolved it (``core.jobs.generation.resolve``, the run's own model's
    resolver). ``trainer.evals.judges`` loads each (the evaluated model itself where it is the same)."""
    lm_eval: dict[str, Any] | None = None
    """An lm-evaluation-harness task (``core.evals.lm_task``): the items are its documents and
    ``trainer.evals.lm_run`` runs it instead of generating and grading."""
    kind: str = KIND
    KIND: ClassVar[str] = KIND

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.testing_criteria:
            raise ValueError("testing_criteria: an eval run needs at least one grader")
        if self.grading_workers is not None and not 0 <= self.grading_workers <= 256:
            raise ValueError(f"grading_workers: {self.grading_workers} is not within 0..256")
        # Here, not at the top: the worker imports this module (the job file) and not the graders
        from trainer.graders.run import model_graders

        for param, grader in (found for i, c in enumerate(self.testing_criteria)
                              for found in model_graders(c, f"testing_criteria[{i}]")):
            if grader["model"] not in self.judges:
                raise ValueError(f"judges: no entry for {grader['model']!r}, the judge {param}.model names")
        for name, judge in self.judges.items():
            if not isinstance(judge, dict) or not judge.get("model") or set(judge) - set(JUDGE_FIELDS):
                raise ValueError(f"judges.{name}: {{'model': ..., 'adapter': ..., 'tokenizer': ...}}, got {judge!r}")


def is_eval_job(raw: dict[str, Any]) -> bool:
    """Whether a parsed job.json is an eval run's."""
    return raw.get("kind") == KIND
