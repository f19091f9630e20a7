"""The trainer's event format: one JSON object per line on stdout.

Standard library only: the worker parses these lines without torch. Every event has
``type`` and ``time`` (Unix seconds, float). Types and their fields:

``plan``        hardware: dict (``trainer.hardware.Hardware`` as a dict), decisions: list of
                {name, enabled, backend, reason}, attention_backend, loss_kernel, total_steps,
                model: {name, params, trainable_params, layers}, resumed_from_step (int | None)
``step``        one per optimizer step, the fields of ``STEP_FIELDS`` (None where unknown, e.g.
                ``mfu`` on CPU or GPU memory without CUDA)
``eval``        step, loss, tokens (validation set)
``log``         level ("debug" | "info" | "warning" | "error"), message
``checkpoint``  step, path (directory), bytes, final (bool)
``done``        status ("succeeded" | "failed" | "cancelled"), error_code (str | None),
                message (str | None), adapter_path (str | None), steps (int)

The trainer always tries to end with one ``done`` event; a process that dies without one is
a crash, and the worker says so from the exit code and stderr.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import IO, Any

EVENT_TYPES = ("plan", "step", "eval", "log", "checkpoint", "done")

STEP_FIELDS = (
    "step",
    "total_steps",
    "epoch",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "sequences",
    "step_ms",
    "data_ms",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "tokens_per_s",
    "mfu",
    "gpu_mem_allocated",
    "gpu_mem_reserved",
    "gpu_mem_peak",
    "host_rss",
)
"""Fields of a ``step`` event. Memory in bytes, times in milliseconds, mfu as a fraction."""

DONE_STATUSES = ("succeeded", "failed", "cancelled")


def make_event(type_: str, **payload: Any) -> dict[str, Any]:
    if type_ not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type_!r}; expected one of {', '.join(EVENT_TYPES)}")
    if type_ == "done" and payload.get("status") not in DONE_STATUSES:
        raise ValueError(f"done.status must be one of {DONE_STATUSES}, got {payload.get('status')!r}")
    return {"type": type_, "time": time.time(), **payload}


def encode(event: dict[str, Any]) -> str:
    """One line of JSON, no trailing newline; NaN/inf become null so every reader can parse it."""
    return json.dumps(_finite(event), separators=(",", ":"), allow_nan=False)


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """Parse one stdout line; None for lines that are not events (stray prints from libraries)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        return None
    return event


class Emitter:
    """Writes events as JSON lines to a stream (stdout by default), thread-safe, flushed per line."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._lock = threading.Lock()

    def __call__(self, type_: str, **payload: Any) -> dict[str, Any]:
        event = make_event(type_, **payload)
        line = encode(event)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()
        return event


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
