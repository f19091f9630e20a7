"""The judges of an eval run's model graders (``score_model``, ``label_model``, also inside a ``multi``).

``load_judges`` loads each distinct judge of ``EvalConfig.judges`` once on the run's device, with
the generation job's loader (``trainer.generate.job.load_model``: the adapter unmerged, the
tokenizer where the worker said), and reuses the evaluated model itself for a judge that is the
same model, adapter and tokenizer (one copy of the weights on the GPU, not two). Each judge is an
``EngineJudge``: ``trainer.graders.judge.engine_judge`` over a one-slot ``Engine`` of its own.

Grading with a judge runs on the runner's thread, between the run's ``generate`` calls
(``trainer.evals.run.grading_workers`` is 0 whenever a criterion names a model): an ``Engine`` is
not thread-safe (one scheduler, one cache, the model's attention switched to the sampler's while it
runs), and a judge that is the evaluated model shares its modules with the run's own engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainer.evals.config import JUDGE_FIELDS, EvalConfig
from trainer.generate.chat import render_messages
from trainer.generate.engine import Engine
from trainer.generate.job import Emit, load_model
from trainer.graders.errors import GraderError
from trainer.graders.judge import Judge, JudgeParams, engine_judge

MIN_LEN = 512
"""Positions of a judge engine's first cache (prompt plus answer); it doubles when a prompt needs more."""


class EngineJudge:
    """A judge over ``model`` (``trainer.graders.judge.Judge``): one request at a time on an
    ``Engine`` of one slot sized to the longest prompt so far plus its ``max_tokens``, rebuilt at
    twice the size when a prompt does not fit (so its cache is allocated a few times per run, not
    per item), never past the model's context."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        config = getattr(model, "config", None)
        self.context = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.engine: Engine | None = None

    def __call__(self, messages: list[dict[str, str]], params: JudgeParams) -> str:
        need = len(render_messages(self.tokenizer, messages)) + params.max_tokens
        if self.context is not None and need > self.context:
            raise GraderError(f"the judge's prompt and max_completions_tokens need {need} positions, over the "
                              f"{self.context} of the judge model's context", "judge")
        if self.engine is None or self.engine.max_len < need:
            size = max(MIN_LEN, self.engine.max_len * 2 if self.engine is not None else 0)
            while size < need:
                size *= 2
            size = min(size, self.context) if self.context is not None else size
            self.engine = Engine(self.model, self.tokenizer, slots=1, max_len=size, device=self.device,
                                 cuda_graphs="auto")
        return engine_judge(self.engine, self.tokenizer)(messages, params)


def load_judges(config: EvalConfig, model: Any, tokenizer: Any, device: torch.device,
                emit: Emit) -> dict[str, Judge]:
    """Each judge of ``config.judges`` by the ``model`` name the graders give (two names of one
    judge share it); ``model`` and ``tokenizer`` are the evaluated model's, already loaded.

    Raises:
        ValueError: a judge's tokenizer has no chat template (the judge is sent chat messages).
        OSError: a judge's weights cannot be read (the run fails before anything is graded).
    """
    own = (config.model, config.adapter, config.tokenizer)
    built: dict[tuple[Any, ...], Judge] = {}
    judges: dict[str, Judge] = {}
    for name, where in config.judges.items():
        key = tuple(where.get(f) for f in JUDGE_FIELDS)
        if key not in built:
            if key == own:
                judge_model, judge_tokenizer = model, tokenizer
                emit("log", level="info", message=f"judge {name}: the evaluated model itself")
            else:
                fields = dict(zip(JUDGE_FIELDS, key))
                judge_model, judge_tokenizer, _ = load_model(dataclasses.replace(config, **fields), device)
                emit("log", level="info", message=f"judge {name}: loaded {fields['model']}"
                     + (f" + adapter {fields['adapter']}" if fields["adapter"] else ""))
            if not getattr(judge_tokenizer, "chat_template", None):
                raise ValueError(f"judge {name}: its tokenizer has no chat template; a score_model or label_model "
                                 "judge is sent chat messages, so name a chat (instruct) model")
            built[key] = EngineJudge(judge_model, judge_tokenizer, device)
        judges[name] = built[key]
    return judges
