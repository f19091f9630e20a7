"""What ``python -m trainer serve session.json`` reads: a chat session (standard library only, so the
worker builds and saves it without torch, as it does ``GenerateConfig``).

A session loads ``model`` once, applies each adapter of ``adapters`` unmerged under its own name
(several adapters of one base in one session; ``BASE`` names the base alone), and answers requests
until it has been idle ``idle_timeout_s`` seconds or is stopped (``trainer.generate.session``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.generate.job_config import DTYPES, JobFile

KIND = "session"
"""``kind`` of a session's job.json."""
BASE = "base"
"""The name under which requests ask for the base model alone."""


@dataclass(frozen=True)
class SessionConfig(JobFile):
    """One chat session."""

    model: str
    """The base's directory or hub id (or a full fine-tune's weights)."""
    adapters: dict[str, str] = field(default_factory=dict)
    """``{name: LoRA adapter directory}``, each applied unmerged on ``model``; a request names one."""
    tokenizer: str | None = None
    """Where the tokenizer and its chat template load from; None: ``model`` (``GenerateConfig.tokenizer``)."""
    slots: int = 8
    """Sequences decoded together (the KV cache's slots)."""
    max_len: int = 2048
    """Positions per slot: a request's prompt plus its ``max_tokens`` must fit."""
    idle_timeout_s: float = 600.0
    """With no request running or arriving for this long, the session ends (status succeeded)."""
    drain_s: float = 30.0
    """On a stop (SIGTERM: a cancel, a preemption) running requests may finish for this long."""
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    job_id: str | None = None
    kind: str = KIND

    def __post_init__(self) -> None:
        if self.kind != KIND:
            raise ValueError(f"kind: a session job.json has kind {KIND!r}, got {self.kind!r}")
        if BASE in self.adapters:
            raise ValueError(f"adapters: {BASE!r} names the base model; pick another adapter name")
        for name in ("slots", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.idle_timeout_s <= 0 or self.drain_s < 0:
            raise ValueError("idle_timeout_s must be > 0 and drain_s >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: one of {', '.join(DTYPES)}, got {self.dtype!r}")


def is_session_job(raw: dict[str, Any]) -> bool:
    """Whether a parsed job.json is a session's."""
    return raw.get("kind") == KIND
