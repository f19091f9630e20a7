"""Trainer events → store rows, written in batches.

The reader thread ``add``s events as the trainer prints them; the job's main thread calls
``flush`` when ``max_batch`` events wait or ``flush_interval_s`` has passed. One flush is one
transaction: every event gets a ``job_event`` row with the next ``seq``, and

    plan        → job.plan, job.total_steps
    step        → a step_metric row, job.progress_step / total_steps
    checkpoint  → a checkpoint row
    eval, log   → the event only

After the commit the highest seq is published on Redis for live viewers. A resumed run
re-emits the steps after its checkpoint: their rows replace the lost attempt's.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any, Callable

from sqlalchemy import delete, update
from sqlalchemy.orm import Session, sessionmaker

from core.jobs.models import Checkpoint, Job, StepMetric
from core.jobs.service import append_events
from trainer.events import STEP_FIELDS

log = logging.getLogger(__name__)

STORED_EVENT_TYPES = ("plan", "step", "eval", "log", "checkpoint")
_METRIC_COLUMNS = tuple(f for f in STEP_FIELDS if f not in ("step", "total_steps"))


def apply_events(session: Session, job_id: str, events: list[dict[str, Any]]) -> int:
    """Write ``events`` (parsed trainer events) for ``job_id`` into ``session``; return the last seq.

    The caller owns the transaction. Events of a type that is not stored (``done``) are skipped.
    """
    stored = [e for e in events if e.get("type") in STORED_EVENT_TYPES]
    if not stored:
        return 0
    job_values: dict[str, Any] = {}
    steps: dict[int, StepMetric] = {}
    checkpoints: dict[int, Checkpoint] = {}
    for event in stored:
        kind = event["type"]
        if kind == "plan":
            job_values["plan"] = _payload(event)
            if event.get("total_steps") is not None:
                job_values["total_steps"] = int(event["total_steps"])
        elif kind == "step":
            row = _step_row(job_id, event)
            steps[row.step] = row
            job_values["progress_step"] = max(row.step, job_values.get("progress_step", 0))
            if event.get("total_steps") is not None:
                job_values["total_steps"] = int(event["total_steps"])
        elif kind == "checkpoint":
            row = _checkpoint_row(job_id, event)
            checkpoints[row.step] = row
    if steps:
        session.execute(delete(StepMetric).where(StepMetric.job_id == job_id, StepMetric.step.in_(list(steps))))
        session.add_all(steps.values())
    if checkpoints:
        session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step.in_(list(checkpoints))))
        session.add_all(checkpoints.values())
    rows = append_events(session, job_id, [(e["type"], _payload(e)) for e in stored])
    if job_values:
        session.execute(
            update(Job).where(Job.job_id == job_id).values(**job_values).execution_options(synchronize_session=False)
        )
    return rows[-1].seq


def _payload(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "type"}


def _event_time(event: dict[str, Any]) -> dt.datetime:
    stamp = event.get("time")
    if isinstance(stamp, (int, float)):
        return dt.datetime.fromtimestamp(stamp, dt.UTC)
    return dt.datetime.now(dt.UTC)


def _step_row(job_id: str, event: dict[str, Any]) -> StepMetric:
    values = {name: event.get(name) for name in _METRIC_COLUMNS}
    return StepMetric(job_id=job_id, step=int(event["step"]), time=_event_time(event), **values)


def _checkpoint_row(job_id: str, event: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        job_id=job_id,
        step=int(event["step"]),
        path=str(event.get("path") or ""),
        bytes=int(event.get("bytes") or 0),
        final=bool(event.get("final", False)),
        created_at=_event_time(event),
    )


class EventRecorder:
    """Buffers one job's events and writes them in batches (one transaction per batch).

    Thread-safe for one producer (``add``) and one writer (``wait`` + ``flush``).
    """

    def __init__(
        self,
        sessionmaker: sessionmaker[Session],
        job_id: str,
        *,
        flush_interval_s: float,
        max_batch: int = 200,
        publish: Callable[[str, int], None] | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.job_id = job_id
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self._publish = publish
        self._buffer: list[dict[str, Any]] = []
        self._ready = threading.Condition()
        self._last_flush = time.monotonic()
        self.batches_written = 0
        self.events_written = 0
        self.last_seq = 0

    def add(self, event: dict[str, Any]) -> None:
        with self._ready:
            self._buffer.append(event)
            if len(self._buffer) >= self.max_batch:
                self._ready.notify_all()

    def pending(self) -> int:
        with self._ready:
            return len(self._buffer)

    def wait(self, timeout: float | None = None) -> None:
        """Block until a full batch waits, the flush interval is over, or ``timeout`` passes."""
        due = self._last_flush + self.flush_interval_s - time.monotonic()
        limit = due if timeout is None else min(due, timeout)
        if limit <= 0:
            return
        with self._ready:
            self._ready.wait_for(lambda: len(self._buffer) >= self.max_batch, timeout=limit)

    def flush_if_due(self) -> int:
        if self.pending() >= self.max_batch or time.monotonic() - self._last_flush >= self.flush_interval_s:
            return self.flush()
        return 0

    def flush(self) -> int:
        """Write every buffered event in one transaction, then publish; return how many were written."""
        with self._ready:
            batch, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        if not batch:
            return 0
        try:
            with self._sessionmaker.begin() as session:
                seq = apply_events(session, self.job_id, batch)
        except Exception:
            with self._ready:
                self._buffer = batch + self._buffer
            raise
        self.batches_written += 1
        self.events_written += len(batch)
        if seq:
            self.last_seq = seq
            if self._publish is not None:
                self._publish(self.job_id, seq)
        return len(batch)
