"""``/v1/jobs/{id}/rollouts``: a GRPO job's shown rollouts per step (``core.jobs.rollouts``): each
step's first ``grpo.log_rollouts`` completions with their prompt, reward, advantage and score by
grader. Paged by step as the metrics are; a job the caller cannot see is a 404."""

from __future__ import annotations

import datetime as dt
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from api.auth import CallerDep
from api.deps import SessionDep
from api.inputs import INT32_MAX
from core.jobs import rollouts

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


class RolloutOut(BaseModel):
    """One shown completion (``trainer.objectives.grpo.shown_rollouts``)."""

    prompt_index: int
    """The prompt's line in the prompts file (0-based)."""
    prompt: str
    completion: str
    """Cut to 2,000 characters (with a trailing …)."""
    completion_tokens: int
    reward: float
    advantage: float
    scores: dict[str, float]
    """Score by grader: a multi grader's graders, else the one grader's name."""


class StepRolloutsOut(BaseModel):
    step: int
    time: dt.datetime
    rollouts: list[RolloutOut]


class RolloutList(BaseModel):
    object: str = "list"
    data: list[StepRolloutsOut]
    next_after_step: int | None
    """Pass as ``after_step`` for the next page; null when this page was not full."""


class RolloutSteps(BaseModel):
    steps: list[int]
    """Every step that showed rollouts, in order."""


@router.get("/{job_id}/rollouts", summary="A GRPO job's shown rollouts, in step order")
def list_rollouts(
    job_id: str,
    session: SessionDep,
    caller: CallerDep,
    step: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Only this step")] = None,
    after_step: Annotated[int, Query(ge=-1, le=INT32_MAX)] = -1,
    limit: Annotated[int, Query(ge=1, le=rollouts.MAX_ROLLOUT_PAGE)] = 50,
) -> RolloutList:
    rows = rollouts.list_rollouts(session, job_id, step=step, after_step=after_step, limit=limit, reader=caller)
    return RolloutList(
        data=[StepRolloutsOut(step=r.step, time=r.time, rollouts=[RolloutOut.model_validate(x) for x in r.rollouts])
              for r in rows],
        next_after_step=rows[-1].step if len(rows) == limit else None,
    )


@router.get("/{job_id}/rollouts/steps", summary="The steps of a GRPO job that showed rollouts")
def list_rollout_steps(job_id: str, session: SessionDep, caller: CallerDep) -> RolloutSteps:
    return RolloutSteps(steps=rollouts.rollout_steps(session, job_id, reader=caller))
