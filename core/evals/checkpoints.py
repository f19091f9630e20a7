"""Which checkpoints of a training job its evals also run on (``JobEval.at_checkpoints``).

    submission   ``check``: the steps a spec names are checkpoints the job will write (a multiple of
                 ``checkpoint_every``, below ``max_steps``: the final step is the ``tuned`` run), the
                 job writes checkpoints at all and they are loadable (LoRA/QLoRA: a ``full`` job's
                 checkpoints are sharded training state); ``'all'`` of a ``max_steps`` job at most
                 ``MAX_RUNS`` of them. Each refusal an ``InvalidInput`` naming ``evals[i].at_checkpoints``.
    success      ``steps``: the steps to run, from the checkpoints the store recorded (an ``epochs`` job's
                 ``'all'`` keeps the last ``MAX_RUNS``); a named step the job never wrote is reported
                 (``missing``) for the training job's log.

Checkpoint runs are queued with the base and tuned runs, after the job has succeeded: a checkpoint
run never competes with its own training job for the GPU, and a failed job runs none.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import InvalidInput
from core.jobs.models import Checkpoint
from core.jobs.spec import JobEval, JobSpec

MAX_RUNS = 16
"""At most this many checkpoint runs per eval (each is a job that loads the model)."""


def check(spec: JobSpec) -> None:
    """Every eval's ``at_checkpoints`` against the job's checkpoints; ``InvalidInput`` otherwise."""
    for i, job_eval in enumerate(spec.evals):
        named = job_eval.at_checkpoints
        if not named:
            continue
        param = f"evals[{i}].at_checkpoints"
        every, max_steps = spec.checkpoint_every, spec.hyperparameters.max_steps
        if spec.method == "full":
            raise InvalidInput(f"{param}: a method full job's checkpoints are sharded training state, not a model "
                               "to evaluate; remove at_checkpoints (the tuned run evaluates its final weights)",
                               param=param)
        if every == 0:
            raise InvalidInput(f"{param}: the job writes no checkpoints; set checkpoint_every (steps between "
                               "checkpoints) or remove at_checkpoints", param=param)
        if named == "all":
            count = (max_steps - 1) // every if max_steps is not None else 0
            if count > MAX_RUNS:
                raise InvalidInput(f"{param}: 'all' is {count} checkpoints (every {every} steps below {max_steps}); "
                                   f"at most {MAX_RUNS}: name the steps or raise checkpoint_every", param=param)
            continue
        for j, step in enumerate(named):
            if step % every or (max_steps is not None and step >= max_steps):
                below = f" below max_steps ({max_steps}; the final step is the tuned run)" if max_steps else ""
                raise InvalidInput(f"{param}[{j}]: step {step} is not a checkpoint of this job: checkpoints are "
                                   f"every {every} steps{below}", param=f"{param}[{j}]")
        if len(set(named)) != len(named):
            raise InvalidInput(f"{param}: a step is named twice", param=param)


@dataclass(frozen=True)
class Steps:
    """The checkpoint steps to run an eval on, and the named ones the job did not write."""

    run: list[int]
    missing: list[int]


def steps(session: Session, job_id: str, job_eval: JobEval) -> Steps:
    """The recorded (non-final) checkpoints ``job_eval.at_checkpoints`` selects, in step order."""
    named = job_eval.at_checkpoints
    if not named:
        return Steps([], [])
    rows = session.execute(select(Checkpoint.step, Checkpoint.final).where(Checkpoint.job_id == job_id)).all()
    final = max((step for step, is_final in rows if is_final), default=None)
    recorded = sorted({step for step, is_final in rows if not is_final and (final is None or step < final)})
    if named == "all":
        return Steps(recorded[-MAX_RUNS:], [])
    wanted = sorted(named)
    return Steps([s for s in wanted if s in recorded], [s for s in wanted if s not in recorded])
