"""What ``python -m trainer generate job.json`` reads: a batch generation job (standard library only,
so the worker builds and saves it without torch, as it does ``trainer.config.TrainConfig``).

The job continues every prompt of ``prompts_file`` (JSONL: chat ``{"messages": [...]}`` or text
``{"prompt": "..."}``) with ``sampling`` (``trainer.generate.params.SamplingParams``' fields) on
the model at ``model`` (a base, a full fine-tune's weights or a merged export), with the LoRA
adapter at ``adapter`` applied unmerged when set. ``trainer.generate.job`` runs it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

KIND = "generate"
"""``kind`` of a generation job.json (a training job.json has none)."""
COMPLETIONS = "completions.jsonl"
"""The output file in ``output_dir``: one line per prompt, in prompt order."""
PARTS = "completions.parts"
"""Where each rank appends its lines while the job runs (merged into ``COMPLETIONS`` at the end)."""
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "logprobs",
                   "top_logprobs", "ignore_eos")
"""The ``SamplingParams`` fields a job may set (``stop_token_ids`` is for code, not files)."""
DTYPES = ("auto", "float32", "bfloat16", "float16")


class JobFile:
    """A dataclass read from and written to a job.json: ``from_dict`` refuses unknown fields (a job
    file written by a newer worker fails loudly instead of dropping what it asked for)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        return cls(**raw)

    @classmethod
    def load(cls, path: str | Path) -> Self:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass(frozen=True)
class GenerateConfig(JobFile):
    """One batch generation run."""

    model: str
    """The model's directory or hub id (the worker resolves ``job:<id>`` and exports to a path)."""
    prompts_file: str
    """The prompts JSONL's path."""
    output_dir: str
    """Where ``completions.jsonl`` is written (and its parts while it runs)."""
    adapter: str | None = None
    """A peft adapter directory applied unmerged on ``model``; None: the model alone."""
    tokenizer: str | None = None
    """Where the tokenizer and its chat template load from (a directory or hub id); None: ``model``.
    Set for a full fine-tune whose ``model/`` has no tokenizer files: its base's (``core.jobs.generation``)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """``SamplingParams`` fields (``SAMPLING_FIELDS``); the rest keep their defaults."""
    slots: int = 16
    """Sequences decoded together per rank (the KV cache's slots)."""
    max_len: int = 0
    """Positions per slot (prompt + completion); 0: the longest prompt plus ``max_tokens``."""
    chunk_prompts: int = 32
    """Prompts per ``Engine.generate`` call: the unit written at once, and so redone after a cancel."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    dtype: str = "auto"
    """Weights' dtype; ``auto``: the base's own on CUDA, float32 on the CPU."""
    trust_remote_code: bool = False
    job_id: str | None = None
    kind: str = KIND
    KIND: ClassVar[str] = KIND
    """The ``kind`` this class's job.json has (an eval run's: ``trainer.evals.config.EvalConfig``)."""

    def __post_init__(self) -> None:
        if self.kind != self.KIND:
            raise ValueError(f"kind: this job.json has kind {self.KIND!r}, got {self.kind!r}")
        unknown = sorted(set(self.sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {', '.join(unknown)}; known: {', '.join(SAMPLING_FIELDS)}")
        for name in ("slots", "chunk_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_len < 0:
            raise ValueError(f"max_len: must be >= 0 (0: sized from the prompts), got {self.max_len}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def completions_path(self) -> Path:
        return Path(self.output_dir) / COMPLETIONS

    @property
    def parts_dir(self) -> Path:
        return Path(self.output_dir) / PARTS



def is_generate_job(raw: dict[str, Any]) -> bool:
    """Whether a parsed job.json is a generation job's."""
    return raw.get("kind") == KIND
