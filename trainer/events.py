"""The trainer's event format: one JSON object per line on stdout.

Standard library only (``trainer.objectives``' registry is too): the worker parses these lines
without torch. Every event has
``type`` and ``time`` (Unix seconds, float). Types and their fields:

``plan``        device, dtype, model_attention, decisions: list of {name, requested, enabled,
                backend, reason} (the kernel choices ``attention``, ``loss``, ``lora_kernel``,
                ``fused_ops``, the multi-rank strategy ``parallelism``, then each switch of
                ``trainer.config.SWITCHES``), hardware: dict (``trainer.plan.hardware.Hardware`` as a
                dict, ``interconnect`` included), world_size, total_steps,
                model: {name, params, trainable_params, layers}, resumed_from_step (int | None)
``step``        one per optimizer step, the fields of ``StepEvent`` then every registered
                objective's step fields (``step_fields()``), no more, no fewer: ``make_event``
                refuses any other payload; an objective's fields are null when another one runs
                (``token_accuracy`` for sft; ``reward_margin``, ``reward_accuracy``,
                ``chosen_logp``, ``rejected_logp`` for dpo: ``trainer.objectives.declarations``)
``eval``        step, loss, tokens, accuracy (validation set; accuracy: the fraction of its target
                tokens the model ranks first, null for DPO)
``skip``        step, loss, grad_norm (None where not finite), consecutive, limit, first_step:
                a non-finite step whose update was not applied (``trainer.training.guards``)
``sample``      step, final (bool), samples: list of {prompt, completion, tokens}: greedy
                generations at a checkpoint and at the end (``trainer.generate.samples``)
``rollouts``    step, rollouts: list of {prompt_index, prompt, completion, completion_tokens, reward,
                advantage, scores: {grader name: score}}: a GRPO step's first ``grpo.log_rollouts``
                completions of rank 0's prompts (texts cut to 2,000 characters), after its ``step``
``log``         level ("debug" | "info" | "warning" | "error"), message
``checkpoint``  step, path (directory), bytes, final (bool)
``done``        status ("succeeded" | "failed" | "cancelled"), error_code (str | None),
                message (str | None), adapter_path (str | None), steps (int)
``progress``    ``python -m trainer export``: stage (``trainer.export.formats.STAGES``), fraction
                (0..1 of that stage); its ``done`` carries path and bytes instead of adapter_path.
                ``python -m trainer generate``: stage "generate", prompts_done, prompts_total,
                tokens, tokens_per_s (``trainer.generate.job``); its ``done`` adds path
``reply``       ``python -m trainer serve``: a session's answer to one request (kind ready, accepted,
                delta, error: ``trainer.generate.session``); relayed to the API, never stored

The trainer always tries to end with one ``done`` event; a process that dies without one is
a crash, and the worker says so from the exit code and stderr.

``StepEvent`` and the objectives' ``MetricField``s are the one definition of a step's fields. What
lives in other processes follows them: the worker's ``step_metric`` rows (``worker.recorder``: a
column per ``StepEvent`` field, the objectives' fields in one JSON column), the API's
``MetricOut``, the SSE ``step`` payload, the dashboard's charts and the trackers;
``tests/unit/test_contracts.py`` fails when one drifts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from trainer import objectives

EVENT_TYPES = ("plan", "step", "eval", "log", "checkpoint", "done", "progress", "skip", "sample", "reply",
               "rollouts")


@dataclass(frozen=True)
class StepEvent:
    """One optimizer step, as the trainer reports it (one ``step`` event: ``fields()``).

    None where a value is unknown or not finite: ``mfu`` without a known peak (CPU), GPU
    memory without CUDA, a NaN loss (``encode`` writes every non-finite float as null).
    """

    step: int
    """Optimizer steps completed, counting this one (1-based)."""
    total_steps: int
    """Optimizer steps the run will take (steps)."""
    epoch: float
    """Passes over the training set so far (fraction, rounded to 4 places)."""
    loss: float | None
    """Mean token cross-entropy of the step (nats per target token); for DPO the mean pair loss."""
    lr: float
    """Learning rate the step used (scheduler value)."""
    grad_norm: float | None
    """Global gradient L2 norm, before clipping (``clip_grad_norm_``'s result)."""
    tokens: int
    """Real (non-padding) tokens in the step's packed micro-batches (tokens)."""
    sequences: int
    """Samples packed into the step (sequences)."""
    step_ms: float
    """Wall time of the whole step (milliseconds)."""
    data_ms: float
    """Moving the packed micro-batches and their metadata to the device (milliseconds)."""
    forward_ms: float
    """Forward passes (milliseconds)."""
    backward_ms: float
    """Backward passes (milliseconds)."""
    optimizer_ms: float
    """Gradient clipping, optimizer and scheduler step (milliseconds)."""
    tokens_per_s: float | None
    """``tokens`` over the step time (tokens per second); None for a zero-length step."""
    mfu: float | None
    """Model FLOPs utilisation (fraction of the device's dense bf16 peak); None when unknown."""
    gpu_mem_allocated: int | None
    """GPU memory held by tensors at the step's end (bytes); None without CUDA."""
    gpu_mem_reserved: int | None
    """GPU memory held by the caching allocator at the step's end (bytes); None without CUDA."""
    gpu_mem_peak: int | None
    """Peak GPU memory held by tensors during the step (bytes); None without CUDA."""
    gpu_alloc_retries: int | None
    """Caching-allocator retries during the step, each a cache flush and a device sync (retries); summed over ranks; None without CUDA."""
    host_rss: int | None
    """Resident set size of the trainer process (bytes); the largest over ranks."""
    ranks: list[dict[str, Any]] | None = None
    """Several ranks: per rank {rank, the step/phase *_ms, tokens, gpu_mem_*, gpu_alloc_retries, host_rss} (the fields above are then the job's); None for one rank."""
    metrics: dict[str, float | None] = field(default_factory=dict)
    """The run's objective's step fields by name (``trainer.objectives``), flat on the wire (``fields()``)."""

    def fields(self) -> dict[str, Any]:
        """The ``step`` event's payload: the fields above, then each registered objective's."""
        payload = {f: getattr(self, f) for f in BASE_STEP_FIELDS}
        unknown = sorted(set(self.metrics) - set(objectives.metric_names()))
        if unknown:
            raise ValueError(f"step.{unknown[0]}: no registered objective declares this step field")
        return {**payload, **{name: self.metrics.get(name) for name in objectives.metric_names()}}

    @classmethod
    def of(cls, payload: dict[str, Any]) -> StepEvent:
        """Back from a ``step`` event's payload (``type`` and ``time`` ignored)."""
        names = set(objectives.metric_names())
        return cls(**{k: v for k, v in payload.items() if k in _BASE_FIELD_SET},
                   metrics={k: v for k, v in payload.items() if k in names and v is not None})


BASE_STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepEvent) if f.name != "metrics")
"""The fields every step has whatever the objective, in ``StepEvent``'s order."""
_BASE_FIELD_SET = frozenset(BASE_STEP_FIELDS)


def step_fields() -> tuple[str, ...]:
    """Every field of a ``step`` event now: ``BASE_STEP_FIELDS``, then the registered objectives'."""
    return BASE_STEP_FIELDS + objectives.metric_names()


STEP_FIELDS: tuple[str, ...] = step_fields()
"""The ``step`` event's fields with the built-in objectives (``step_fields()`` also counts any
registered since)."""

DONE_STATUSES = ("succeeded", "failed", "cancelled")


def make_event(type_: str, **payload: Any) -> dict[str, Any]:
    """The event ``type_`` with ``payload`` and the current time.

    Raises:
        ValueError: an unknown type, a ``done`` without a known status, or a ``step`` whose
            fields are not exactly ``STEP_FIELDS`` (the message names the first field at fault).
    """
    if type_ not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type_!r}; expected one of {', '.join(EVENT_TYPES)}")
    if type_ == "done" and payload.get("status") not in DONE_STATUSES:
        raise ValueError(f"done.status must be one of {DONE_STATUSES}, got {payload.get('status')!r}")
    if type_ == "step":
        _check_step(payload)
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


def _check_step(payload: dict[str, Any]) -> None:
    fields = step_fields()
    known = frozenset(fields)
    unknown = [name for name in payload if name not in known]
    if unknown:
        raise ValueError(f"step.{unknown[0]}: not a field of StepEvent (fields: {', '.join(fields)})")
    missing = [name for name in fields if name not in payload]
    if missing:
        raise ValueError(f"step.{missing[0]}: missing; a step event carries every field of StepEvent")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
