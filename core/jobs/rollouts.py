"""A GRPO job's shown rollouts (``step_rollout`` rows, written by the worker's recorder from the
trainer's ``rollouts`` events): read by step, paged, for ``GET /v1/jobs/{id}/rollouts``.

Each read first reads the job as the caller (``core.jobs.service.get_job``): a job the caller
cannot see is a 404, as for its metrics.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import InvalidInput
from core.jobs.models import StepRollout
from core.jobs.service import get_job
from core.users.service import Caller

MAX_ROLLOUT_PAGE = 200
"""Steps a page holds at most (each up to ``grpo.log_rollouts`` = 64 rollouts of 2 x 2,000 characters)."""


def list_rollouts(session: Session, job_id: str, *, step: int | None = None, after_step: int = -1,
                  limit: int = 50, reader: Caller | None = None) -> list[StepRollout]:
    """The steps' rows with ``step > after_step`` in step order (at most ``limit``), or ``step``'s
    alone (none when it showed no rollouts)."""
    get_job(session, job_id, reader=reader)
    if not 1 <= limit <= MAX_ROLLOUT_PAGE:
        raise InvalidInput(f"limit: must be between 1 and {MAX_ROLLOUT_PAGE}, got {limit}", param="limit")
    query = select(StepRollout).where(StepRollout.job_id == job_id)
    if step is not None:
        query = query.where(StepRollout.step == step)
    return list(session.scalars(query.where(StepRollout.step > after_step).order_by(StepRollout.step).limit(limit)))


def rollout_steps(session: Session, job_id: str, *, reader: Caller | None = None) -> list[int]:
    """Every step of the job that showed rollouts, in order (the job page's step selector)."""
    get_job(session, job_id, reader=reader)
    query = select(StepRollout.step).where(StepRollout.job_id == job_id).order_by(StepRollout.step)
    return list(session.scalars(query))
