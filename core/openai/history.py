"""The reads behind a job's history in OpenAI's terms (``api.openai.reports`` shapes them):
events and checkpoints newest first, step metrics, validation results and trained tokens.

All of it is what the worker already stores (``job_event``, ``step_metric``, ``checkpoint``):
nothing is written twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.jobs.models import Checkpoint, JobEvent, StepMetric


def events_newest_first(session: Session, job_id: str, *, before_seq: int | None,
                        limit: int) -> tuple[list[JobEvent], bool]:
    """At most ``limit`` of the job's events with ``seq < before_seq`` (None: all), newest
    first, and whether more follow."""
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if before_seq is not None:
        query = query.where(JobEvent.seq < before_seq)
    rows = list(session.scalars(query.order_by(JobEvent.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def checkpoints_newest_first(session: Session, job_id: str, *, before_step: int | None,
                             limit: int) -> tuple[list[Checkpoint], bool]:
    """At most ``limit`` of the job's checkpoints with ``step < before_step`` (None: all),
    newest first, and whether more follow."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    rows = list(session.scalars(query.order_by(Checkpoint.step.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def step_metrics(session: Session, job_id: str, steps: Iterable[int] | None = None) -> list[StepMetric]:
    """The job's step rows in step order; ``steps``: only those."""
    query = select(StepMetric).where(StepMetric.job_id == job_id)
    if steps is not None:
        query = query.where(StepMetric.step.in_(list(steps)))
    return list(session.scalars(query.order_by(StepMetric.step)))


def eval_results(session: Session, job_id: str) -> dict[int, tuple[float | None, float | None]]:
    """step -> (validation loss, validation token accuracy) of each ``eval`` event."""
    rows = session.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "eval"))
    return {int(data["step"]): (data.get("loss"), data.get("accuracy"))
            for data in rows if isinstance(data.get("step"), int)}


def trained_tokens(session: Session, job_ids: list[str]) -> dict[str, int]:
    """Real tokens over every recorded step, per job (a job without step rows is left out)."""
    rows = session.execute(
        select(StepMetric.job_id, func.sum(StepMetric.tokens), func.count())
        .where(StepMetric.job_id.in_(job_ids)).group_by(StepMetric.job_id)
    )
    return {job_id: int(total or 0) for job_id, total, _ in rows}
