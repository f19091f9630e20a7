"""Trainer events → store rows, written in batches.

The reader thread ``add``s events as the trainer prints them; the job's main thread calls
``flush`` when ``max_batch`` events wait or ``flush_interval_s`` has passed. One flush is one
transaction: every event gets a ``job_event`` row with the next ``seq``, and

    plan        → job.plan, job.total_steps
    step        → a step_metric row, job.progress_step / total_steps
    checkpoint  → a checkpoint row
    eval        → an eval_metric row
    rollouts    → a step_rollout row (a GRPO step's shown rollouts; the event is kept too, for live viewers)
    progress    → job.summary (a generation job's prompts_done, prompts_total, tokens, tokens_per_s)
    skip, sample, log → the event only
    step, eval, skip → job.summary recomputed from the rows (``core.jobs.summary``)

After the commit the highest seq is published on Redis for live viewers. A resumed run
re-emits the steps after its checkpoint: their rows replace the lost attempt's.

A recorder given its claim (``worker_id``, ``attempt``) first locks the job row on the condition
that the claim still holds; a worker whose job was reaped and claimed by another must not write
into the new attempt's history, so the batch is dropped and ``lost`` is set (the runner kills
its trainer). An event the store rejects (a malformed event, a value the column refuses) is
dropped by itself: the batch is retried one event per transaction, so one bad event cannot
block every later one. Only a connection failure keeps the events for the next flush.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any, Callable

from sqlalchemy import delete, update
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.db import utcnow
from core.jobs.models import Checkpoint, EvalMetric, Job, StepMetric, StepRollout
from core.jobs.summary import summarize
from core.jobs.service import append_events
from core.jobs.states import JobStatus
from trainer import objectives
from trainer.events import BASE_STEP_FIELDS

log = logging.getLogger(__name__)

STORED_EVENT_TYPES = ("plan", "step", "eval", "log", "checkpoint", "skip", "sample", "progress", "rollouts")
GENERATION_PROGRESS = ("prompts_done", "prompts_total", "tokens", "tokens_per_s")
"""A generation job's ``progress`` fields (``trainer.generate.job``), kept as its summary."""
_METRIC_COLUMNS = tuple(f for f in BASE_STEP_FIELDS if f not in ("step", "total_steps"))


def apply_events(session: Session, job_id: str, events: list[dict[str, Any]]) -> int:
    """Write ``events`` (parsed trainer events) for ``job_id`` into ``session``; return the last seq.

    The caller owns the transaction. Events of a type that is not stored (``done``) are skipped;
    so is (with a warning) an event whose fields do not map to its rows (a ``step`` without
    ``step``): the trainer's output is not trusted to be well formed. NULs are stripped from
    strings (PostgreSQL's JSONB and text columns reject them).
    """
    job_values: dict[str, Any] = {}
    rows: dict[type, dict[int, Any]] = {model: {} for model in (StepMetric, Checkpoint, EvalMetric, StepRollout)}
    stored: list[dict[str, Any]] = []
    for raw in events:
        if raw.get("type") not in STORED_EVENT_TYPES:
            continue
        event = _strip_nul(raw)
        kind = event["type"]
        try:
            row = _ROWS[kind](job_id, event) if kind in _ROWS else None
            values: dict[str, Any] = {}
            if kind == "plan":
                values["plan"] = _payload(event)
            if kind in ("plan", "step") and event.get("total_steps") is not None:
                values["total_steps"] = int(event["total_steps"])
            if kind == "progress":
                values["summary"] = {name: event[name] for name in GENERATION_PROGRESS}
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("job %s: dropped a malformed %r event (%r): %s", job_id, kind, exc, _preview(event))
            continue
        job_values.update(values)
        if row is not None:
            rows[type(row)][row.step] = row
        if kind == "step":
            job_values["progress_step"] = max(row.step, job_values.get("progress_step", 0))
        stored.append(event)
    if not stored:
        return 0
    for model, by_step in rows.items():
        _replace_rows(session, model, job_id, by_step)
    appended = append_events(session, job_id, [(e["type"], _payload(e)) for e in stored])
    if rows[StepMetric] or rows[EvalMetric] or any(e["type"] == "skip" for e in stored):
        job_values["summary"] = summarize(session, job_id)
    if job_values:
        session.execute(
            update(Job).where(Job.job_id == job_id).values(**job_values).execution_options(synchronize_session=False)
        )
    return appended[-1].seq


def _replace_rows(session: Session, model: Any, job_id: str, by_step: dict[int, Any]) -> None:
    """Store ``by_step``'s rows of ``model`` for ``job_id`` in place of those of the same steps
    (a retry re-emits the steps after its checkpoint)."""
    if by_step:
        session.execute(delete(model).where(model.job_id == job_id, model.step.in_(list(by_step))))
        session.add_all(by_step.values())


def _strip_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "")
    if isinstance(value, dict):
        return {_strip_nul(k): _strip_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_nul(v) for v in value]
    return value


def _preview(event: dict[str, Any]) -> str:
    text = repr(event)
    return text if len(text) <= 200 else text[:200] + "..."


def _payload(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "type"}


def _event_time(event: dict[str, Any]) -> dt.datetime:
    stamp = event.get("time")
    if isinstance(stamp, (int, float)):
        return dt.datetime.fromtimestamp(stamp, dt.UTC)
    return dt.datetime.now(dt.UTC)


def _step_row(job_id: str, event: dict[str, Any]) -> StepMetric:
    values = {name: event.get(name) for name in _METRIC_COLUMNS}
    metrics = {name: event[name] for name in objectives.metric_names() if event.get(name) is not None}
    if metrics:  # else SQL NULL (the column's default), not a JSON null
        values["metrics"] = metrics
    return StepMetric(job_id=job_id, step=int(event["step"]), time=_event_time(event), **values)


def _eval_row(job_id: str, event: dict[str, Any]) -> EvalMetric:
    loss = event.get("loss")
    tokens = event.get("tokens")
    return EvalMetric(job_id=job_id, step=int(event["step"]), loss=None if loss is None else float(loss),
                      tokens=None if tokens is None else int(tokens), time=_event_time(event))


def _rollout_row(job_id: str, event: dict[str, Any]) -> StepRollout:
    shown = event["rollouts"]
    if not isinstance(shown, list) or not all(isinstance(r, dict) for r in shown):
        raise TypeError("rollouts: a list of objects")
    return StepRollout(job_id=job_id, step=int(event["step"]), rollouts=shown, time=_event_time(event))


def _checkpoint_row(job_id: str, event: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        job_id=job_id,
        step=int(event["step"]),
        path=str(event.get("path") or ""),
        bytes=int(event.get("bytes") or 0),
        final=bool(event.get("final", False)),
        created_at=_event_time(event),
    )


_ROWS: dict[str, Callable[[str, dict[str, Any]], Any]] = {
    "step": _step_row, "checkpoint": _checkpoint_row, "eval": _eval_row, "rollouts": _rollout_row}
"""The event types kept as rows of their own (beside the event), each row keyed by the job and its step."""


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
        worker_id: str | None = None,
        attempt: int | None = None,
    ) -> None:
        """``worker_id`` and ``attempt`` name the claim; given, every write first checks it still holds."""
        self._sessionmaker = sessionmaker
        self.worker_id = worker_id
        self.attempt = attempt
        self.lost = False
        """Set once a flush found the job no longer this claim's; later events are dropped."""
        self.events_dropped = 0
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
        """Write every buffered event, then publish; return how many events were handled.

        One transaction for the batch; if it fails for any reason but a connection failure, one
        transaction per event, dropping the events the store rejects. A connection failure puts
        the unwritten events back (front of the buffer) and re-raises.
        """
        with self._ready:
            batch, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        if not batch:
            return 0
        if self.lost:
            self.events_dropped += len(batch)
            return 0
        try:
            self._commit(batch)
        except _ClaimLost:
            self._lose(batch)
            return 0
        except Exception as exc:
            if _is_connection_error(exc):
                self._put_back(batch)
                raise
            log.warning("job %s: a batch of %d events was refused (%s); writing them one by one",
                        self.job_id, len(batch), exc)
            self._one_by_one(batch)
        return len(batch)

    def _one_by_one(self, batch: list[dict[str, Any]]) -> None:
        for index, event in enumerate(batch):
            try:
                self._commit([event])
            except _ClaimLost:
                self._lose(batch[index:])
                return
            except Exception as exc:
                if _is_connection_error(exc):
                    self._put_back(batch[index:])
                    raise
                self.events_dropped += 1
                log.warning("job %s: dropped a %r event the store refused: %s %s",
                            self.job_id, event.get("type"), exc, _preview(event))

    def _commit(self, events: list[dict[str, Any]]) -> None:
        with self._sessionmaker.begin() as session:
            if self.worker_id is not None and not self._still_ours(session):
                raise _ClaimLost
            seq = apply_events(session, self.job_id, events)
        self.batches_written += 1
        self.events_written += len(events)
        if seq:
            self.last_seq = seq
            if self._publish is not None:
                self._publish(self.job_id, seq)

    def _still_ours(self, session: Session) -> bool:
        """Lock the job row if this claim still holds it (the same test as watchdog.Watchdog)."""
        return session.execute(
            update(Job)
            .where(Job.job_id == self.job_id, Job.status == JobStatus.running.value,
                   Job.worker_id == self.worker_id, Job.attempts == self.attempt)
            .values(updated_at=utcnow())
            .execution_options(synchronize_session=False)
        ).rowcount == 1

    def _lose(self, events: list[dict[str, Any]]) -> None:
        if not self.lost:
            log.warning("job %s is no longer attempt %s of worker %s; dropping its events from now on",
                        self.job_id, self.attempt, self.worker_id)
        self.lost = True
        self.events_dropped += len(events)

    def _put_back(self, events: list[dict[str, Any]]) -> None:
        with self._ready:
            self._buffer = events + self._buffer


class _ClaimLost(Exception):
    """The job is no longer the recorder's claim (reaped, claimed by another worker)."""


def _is_connection_error(exc: BaseException) -> bool:
    """The store could not be reached: the events are fine, so keep them for the next flush."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return bool(getattr(exc, "connection_invalidated", False))
