"""The models ``/openai/v1/models`` shows a caller, and OpenAI's names of the tuned ones.

    <base>                                   a model under ``FTQ_MODEL_ROOT``, as ``GET /v1/models``
                                             lists it (``core.jobs.model_catalog``): any caller may train it
    ft:<base>:<owner>:<suffix>:<job id>      a succeeded training job's final weights: the job
                                             object's ``fine_tuned_model``
    ft:<...>:<job id>:ckpt-step-<step>       one of a training job's checkpoints: the checkpoint
                                             object's ``fine_tuned_model_checkpoint``

The tuned models are those of the training jobs the caller reads on ``/openai/v1``
(``core.users.access.readable_by``: their own in the project ``OpenAI-Project`` selects; an
admin's, everyone's there). Another user's or project's name answers as an unknown one. Hub ids,
which a job may also name, are not listed: nothing on the box enumerates them.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import ModelNotFound, NotFound
from core.jobs import service
from core.jobs.model_catalog import model_dirs
from core.jobs.models import Checkpoint, Job
from core.jobs.states import JobStatus
from core.openai.models import OpenAIJob
from core.users.access import owner_name, readable_by
from core.users.models import User
from core.users.service import Caller

ORGANIZATION = "ftq"
"""``organization_id`` of every job, and the owner in the names of jobs without one."""
_CHECKPOINT = re.compile(r"^(?P<model>ft:.+):ckpt-step-(?P<step>[0-9]{1,18})$")


@dataclass(frozen=True)
class ListedModel:
    """One model as OpenAI's ``Model`` object has it."""

    id: str
    created: int
    """Unix seconds: a base's config.json written, a job finished, a checkpoint saved."""
    owned_by: str
    """``ftq`` for a base; the job's owner for a tuned model (the ``<owner>`` of its name)."""


def fine_tuned_model(job: Job, owner: str | None, suffix: str | None) -> str:
    """OpenAI's ``ft:<base>:<org>:<suffix>:<id>``, with ftq's owner and job id: the job's adapter."""
    return f"ft:{job.model}:{owner or ORGANIZATION}:{suffix or ''}:{job.job_id}"


def checkpoint_model(fine_tuned: str, step: int) -> str:
    """The name of the checkpoint at ``step`` of the job whose model is ``fine_tuned``."""
    return f"{fine_tuned}:ckpt-step-{step}"


def list_models(session: Session, caller: Caller, model_root: Path) -> list[ListedModel]:
    """The bases by name, then each readable training job's model (once succeeded) and its
    checkpoints (newest first), newest job first."""
    out = [ListedModel(name, _written(directory), ORGANIZATION) for name, directory in model_dirs(model_root).items()]
    rows = session.execute(
        select(Job, OpenAIJob.job_id, OpenAIJob.suffix, User.name)
        .outerjoin(OpenAIJob, OpenAIJob.job_id == Job.job_id).outerjoin(User, User.user_id == Job.owner_id)
        .where(Job.kind == "train", readable_by(caller, Job)).order_by(Job.created_at.desc(), Job.job_id.desc())
    ).all()
    steps = _checkpoints(session, caller)
    for job, openai_id, suffix, owner in rows:
        name = fine_tuned_model(job, owner, suffix if openai_id is not None else job.name)
        if job.status == JobStatus.succeeded.value:
            out.append(ListedModel(name, _unix(job.finished_at or job.created_at), owner or ORGANIZATION))
        out += [ListedModel(checkpoint_model(name, step), created, owner or ORGANIZATION)
                for step, created in steps.get(job.job_id, [])]
    return out


def get_model(session: Session, caller: Caller, model: str, model_root: Path) -> ListedModel:
    """The model named ``model``, if ``list_models`` would show it to ``caller``.

    Raises:
        ModelNotFound: no such base, job or checkpoint, or one the caller may not read (alike).
    """
    if model.startswith("ft:"):
        found = _tuned(session, caller, model)
    else:
        directory = model_dirs(model_root).get(model)
        found = ListedModel(model, _written(directory), ORGANIZATION) if directory is not None else None
    if found is None:
        raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")
    return found


def _tuned(session: Session, caller: Caller, model: str) -> ListedModel | None:
    """A job's model or checkpoint by its full name: the job id is the name's last field."""
    match = _CHECKPOINT.match(model)
    name, step = (match["model"], int(match["step"])) if match else (model, None)
    try:
        job = service.get_job(session, name.rpartition(":")[2], reader=caller)
    except NotFound:
        return None
    extra = session.get(OpenAIJob, job.job_id)
    owner = owner_name(session, job.owner_id)
    if job.kind != "train" or name != fine_tuned_model(job, owner, extra.suffix if extra else job.name):
        return None
    if step is None:
        if job.status != JobStatus.succeeded.value:
            return None
        return ListedModel(name, _unix(job.finished_at or job.created_at), owner or ORGANIZATION)
    checkpoint = session.get(Checkpoint, (job.job_id, step))
    if checkpoint is None:
        return None
    return ListedModel(model, _unix(checkpoint.created_at), owner or ORGANIZATION)


def _checkpoints(session: Session, caller: Caller) -> dict[str, list[tuple[int, int]]]:
    """``{job id: [(step, created), ...] newest first}`` over the caller's readable training jobs."""
    rows = session.execute(
        select(Checkpoint.job_id, Checkpoint.step, Checkpoint.created_at).join(Job, Job.job_id == Checkpoint.job_id)
        .where(Job.kind == "train", readable_by(caller, Job)).order_by(Checkpoint.job_id, Checkpoint.step.desc())
    )
    out: dict[str, list[tuple[int, int]]] = {}
    for job_id, step, created in rows:
        out.setdefault(job_id, []).append((step, _unix(created)))
    return out


def _written(directory: Path) -> int:
    try:
        return int(os.stat(directory / "config.json").st_mtime)
    except OSError:
        return 0


def _unix(when: dt.datetime) -> int:
    return int(when.timestamp())


def reference(session: Session, caller: Caller, model: str, model_root: Path) -> str:
    """The ftq reference (``job:<id>``, ``job:<id>@<step>`` or the base's name) of a model
    ``list_models`` shows ``caller``.

    Raises:
        ModelNotFound: as ``get_model``.
    """
    get_model(session, caller, model, model_root)
    if not model.startswith("ft:"):
        return model
    match = _CHECKPOINT.match(model)
    name = match["model"] if match else model
    job_ref = f"job:{name.rpartition(':')[2]}"
    return f"{job_ref}@{int(match['step'])}" if match else job_ref
