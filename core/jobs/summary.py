"""A job's results in one small dict (``job.summary``): what a team reads before the curves.

Recomputed from the stored rows by the worker's recorder whenever a batch brings step or eval
rows (``worker.recorder``), so a resumed run, whose re-emitted steps replace the lost attempt's
rows, is never counted twice. The queries read one job's rows by their primary key prefix.

A step whose loss or grad norm was not finite (stored as null) was not applied
(``trainer.training.guards``): it counts as skipped, and its tokens are not trained tokens.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.jobs.models import EvalMetric, JobEvent, StepMetric


def summarize(session: Session, job_id: str) -> dict[str, Any]:
    """``{final_train_loss, best_train_loss, trained_tokens, steps, skipped_steps, final_eval_loss,
    best_eval_loss, best_eval_step}`` of ``job_id`` (None where there is no row yet)."""
    applied = (StepMetric.job_id == job_id, StepMetric.loss.is_not(None), StepMetric.grad_norm.is_not(None))
    best, tokens, steps = session.execute(
        select(func.min(StepMetric.loss), func.sum(StepMetric.tokens), func.count()).where(*applied)
    ).one()
    total = session.scalar(select(func.count()).where(StepMetric.job_id == job_id)) or 0
    final = session.scalar(select(StepMetric.loss).where(*applied).order_by(StepMetric.step.desc()).limit(1))
    evals = EvalMetric.job_id == job_id, EvalMetric.loss.is_not(None)
    final_eval = session.scalar(select(EvalMetric.loss).where(*evals).order_by(EvalMetric.step.desc()).limit(1))
    best_eval = session.execute(
        select(EvalMetric.loss, EvalMetric.step).where(*evals).order_by(EvalMetric.loss, EvalMetric.step).limit(1)
    ).first()
    return {
        "final_train_loss": final,
        "best_train_loss": best,
        "trained_tokens": int(tokens or 0),
        "steps": total,
        "skipped_steps": total - steps,
        "final_eval_loss": final_eval,
        "best_eval_loss": best_eval[0] if best_eval else None,
        "best_eval_step": best_eval[1] if best_eval else None,
    }


def step_totals(session: Session, job_id: str) -> tuple[int, float | None, float | None, int]:
    """``(last step, final loss, best loss, tokens)`` over every stored step row (the adapter card's)."""
    steps, best, tokens = session.execute(
        select(func.max(StepMetric.step), func.min(StepMetric.loss), func.coalesce(func.sum(StepMetric.tokens), 0))
        .where(StepMetric.job_id == job_id)).one()
    final = session.execute(select(StepMetric.loss).where(StepMetric.job_id == job_id)
                            .order_by(StepMetric.step.desc()).limit(1)).scalar_one_or_none()
    return int(steps or 0), final, best, int(tokens)


def eval_losses(session: Session, job_id: str) -> list[float]:
    """The validation loss of each ``eval`` event, in order."""
    rows = session.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.type == "eval")
                           .order_by(JobEvent.seq))
    return [float(d["loss"]) for d in rows if isinstance(d.get("loss"), (int, float))]
