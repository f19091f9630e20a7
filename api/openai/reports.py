"""A job's history in OpenAI's terms: events (message and metrics), checkpoints with their
metrics, and the metrics CSV OpenAI attaches as a result file.

All of it is read from what the worker already stores (``core.openai.history``): nothing is
written twice. Event and checkpoint ids carry the job and the
position (``ftevent-<job>-<seq>``, ``ftckpt-<job>-<step>``) so ``after=`` pages by them.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from sqlalchemy.orm import Session

from api.openai.schemas import CheckpointMetrics, JobCheckpoint, JobEvent
from core.errors import InvalidInput
from core.jobs.models import Job
from core.jobs.models import JobEvent as StoredEvent
from core.openai import history
from core.openai.catalog import checkpoint_model
from trainer import objectives

CSV_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")
ACCURACY = "token_accuracy"
"""The step field OpenAI names ``train_mean_token_accuracy`` (sft's); the objectives' other step
fields (``trainer.objectives``: DPO's rewards and log-probs) go into a step's metrics under their own names."""
_LEVELS = {"debug": "info", "info": "info", "warning": "warn", "error": "error"}


def list_events(session: Session, job_id: str, *, after: str | None, limit: int) -> tuple[list[JobEvent], bool]:
    """Newest first, as OpenAI lists them; ``after`` is the id of the last event already read."""
    before = _position(after, "ftevent", job_id) if after is not None else None
    rows, more = history.events_newest_first(session, job_id, before_seq=before, limit=limit)
    return [event_of(job_id, row) for row in rows], more


def event_of(job_id: str, row: StoredEvent) -> JobEvent:
    level, message, data, kind = _describe(row.type, row.data)
    return JobEvent(
        id=f"ftevent-{_hex(job_id)}-{row.seq}",
        created_at=int(row.created_at.timestamp()),
        level=level,  # type: ignore[arg-type]
        message=message,
        data=data,
        type=kind,  # type: ignore[arg-type]
    )


def _describe(type_: str, data: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None, str]:
    """``(level, message, data, type)`` of one stored event."""
    if type_ == "step":
        metrics = {"step": data.get("step"), "train_loss": data.get("loss"), "total_steps": data.get("total_steps"),
                   "train_mean_token_accuracy": data.get(ACCURACY)}
        metrics.update({k: data[k] for k in objectives.metric_names() if k != ACCURACY and data.get(k) is not None})
        message = f"Step {data.get('step')}/{data.get('total_steps')}: training loss={_num(data.get('loss'))}"
        return "info", message, metrics, "metrics"
    if type_ == "eval":
        metrics = {"step": data.get("step"), "valid_loss": data.get("loss"), "full_valid_loss": data.get("loss"),
                   "valid_mean_token_accuracy": data.get("accuracy"),
                   "full_valid_mean_token_accuracy": data.get("accuracy")}
        return "info", f"Step {data.get('step')}: validation loss={_num(data.get('loss'))}", metrics, "metrics"
    if type_ == "state":
        return _state_message(data)
    if type_ == "log":
        return _LEVELS.get(str(data.get("level")), "info"), str(data.get("message", "")), None, "message"
    if type_ == "checkpoint":
        what = "Final model written" if data.get("final") else "Checkpoint created"
        return "info", f"{what} at step {data.get('step')}", {"step": data.get("step")}, "message"
    if type_ == "plan":
        model = (data.get("model") or {}).get("name", "the model")
        return "info", (f"Training plan: {data.get('total_steps')} steps of {model} on {data.get('device')} "
                        f"({data.get('dtype')})"), None, "message"
    if type_ == "rollouts":  # a GRPO step's shown rollouts (docs/grpo.md): kept whole in data
        shown = data.get("rollouts") or []
        return "info", f"Step {data.get('step')}: {len(shown)} rollouts shown", data, "message"
    return "info", f"{type_} event", data, "message"


def _state_message(data: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None, str]:
    status = data.get("status")
    note = data.get("message") or data.get("reason")
    if data.get("paused"):
        return "info", "Fine-tuning job paused (stopped at a checkpoint; resume continues from it)", None, "message"
    text = {
        "queued": "Fine-tuning job queued" if not data.get("resumed") else "Fine-tuning job resumed and queued",
        "running": "Fine-tuning job started",
        "succeeded": "The job has successfully completed",
        "failed": "The job failed",
        "cancelled": "Fine-tuning job cancelled",
    }.get(str(status), f"Job {status}")
    if note:
        text += f": {note}"
    return ("error" if status == "failed" else "info"), text, None, "message"


def list_checkpoints(session: Session, job: Job, model_name: str, *, after: str | None,
                     limit: int) -> tuple[list[JobCheckpoint], bool]:
    """The job's checkpoints newest first, each with the metrics of its step."""
    before = _position(after, "ftckpt", job.job_id) if after is not None else None
    page, more = history.checkpoints_newest_first(session, job.job_id, before_step=before, limit=limit)
    train = {m.step: m for m in history.step_metrics(session, job.job_id, {row.step for row in page})}
    valid = history.eval_results(session, job.job_id)
    out = []
    for row in page:
        metric = train.get(row.step)
        loss, accuracy = valid.get(row.step, (None, None))
        out.append(JobCheckpoint(
            id=f"ftckpt-{_hex(job.job_id)}-{row.step}",
            created_at=int(row.created_at.timestamp()),
            fine_tuned_model_checkpoint=checkpoint_model(model_name, row.step),
            fine_tuning_job_id=job.job_id,
            step_number=row.step,
            metrics=CheckpointMetrics(
                step=row.step,
                train_loss=metric.loss if metric else None,
                train_mean_token_accuracy=(metric.metrics or {}).get(ACCURACY) if metric else None,
                valid_loss=loss,
                valid_mean_token_accuracy=accuracy,
                full_valid_loss=loss,
                full_valid_mean_token_accuracy=accuracy,
            ),
        ))
    return out, more


def metrics_csv(session: Session, job_id: str) -> str:
    """OpenAI's results file: one row per step; validation columns where the step was evaluated."""
    valid = history.eval_results(session, job_id)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in history.step_metrics(session, job_id):
        loss, accuracy = valid.get(row.step, (None, None))
        writer.writerow([row.step, _cell(row.loss), _cell((row.metrics or {}).get(ACCURACY)), _cell(loss),
                         _cell(accuracy)])
    return buffer.getvalue()


def _position(cursor: str, prefix: str, job_id: str) -> int:
    head, _, number = cursor.rpartition("-")
    if head != f"{prefix}-{_hex(job_id)}" or not number.isdigit():
        raise InvalidInput(
            f"after: {cursor!r} is not a {prefix} id of job {job_id}; pass the id of the last item of the "
            "previous page",
            param="after",
        )
    return int(number)


def _hex(job_id: str) -> str:
    return job_id.removeprefix("job-")


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "n/a"


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"
