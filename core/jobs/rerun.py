"""Clone a job with overrides, or resume a stopped one from a chosen checkpoint.

Both make a NEW job, so a finished job's record, metrics and files stay as they were, and both
are submissions like any other: the spec built here goes through ``core.jobs.submit`` with the
same checks and dataset preflight as ``POST /v1/jobs`` (a dataset, model or setting refused for a
new job is refused for a rerun of an old one, with the same 422).

- clone: the source's stored spec (every default filled in, so a later change of the defaults
  does not change a re-run) merged with the caller's overrides as a JSON merge patch (RFC 7386:
  objects merge key by key, ``null`` removes a key and so restores its default), then validated
  like a submission. Setting ``hyperparameters.max_steps`` drops the source's ``epochs`` and the
  other way round, since the two exclude each other.
- resume: the source (``failed`` or ``cancelled``) with its spec unchanged; the chosen checkpoint
  (default: the newest) is linked into the new job's directory (hard links, a copy across
  filesystems) and recorded as its checkpoint, so the trainer's resume picks it up and the
  new job continues at the next step. A checkpoint the machines wrote to their shared
  directory (a Slurm job's, a multi-machine job's) is read through the API host's own mount of it
  (``FTQ_SHARED_DIR``) and linked into the new job's directory there (``seed_checkpoint``). The
  new job's metrics start there; the source has the steps before.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from core.db import utcnow
from core.errors import Conflict, InvalidInput, NotFound
from core.jobs import artifact_store, service
from core.jobs.eval_spec import is_eval
from core.jobs.generate_spec import GenerateSpec, is_generate
from core.jobs.models import Checkpoint, Job
from core.jobs.spec import JobSpec
from core.jobs.states import JobStatus
from core.settings import Settings
from trainer.training import layout

Spec = TypeVar("Spec", JobSpec, GenerateSpec)

RESUMABLE = (JobStatus.failed.value, JobStatus.cancelled.value)
_LENGTH_KEYS = ("max_steps", "epochs")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: ``patch`` applied to ``target`` (neither is modified)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def cloned_spec(source_spec: dict[str, Any], overrides: dict[str, Any]) -> JobSpec | GenerateSpec:
    """The source's spec with ``overrides`` (a generation job's: a ``GenerateSpec``); raises
    pydantic's ValidationError like a submission."""
    base = dict(source_spec)
    if is_eval(base):  # its run row, prompts and criteria belong to one run: a new run is a new job
        raise InvalidInput(f"job: an eval run's job is not cloned; create another run of eval {base.get('eval_id')} "
                           "(evals.runs.create, `ftq eval run`)", param="job_id")
    if is_generate(base):
        return GenerateSpec.model_validate(merge_patch(base, overrides))
    hp_patch = overrides.get("hyperparameters")
    if isinstance(hp_patch, dict) and any(hp_patch.get(k) is not None for k in _LENGTH_KEYS):
        base["hyperparameters"] = {k: v for k, v in (base.get("hyperparameters") or {}).items() if k not in _LENGTH_KEYS}
    return JobSpec.model_validate(merge_patch(base, overrides))


def pick_checkpoint(session: Session, source: Job, step: int | None, *, settings: Settings) -> Checkpoint:
    """The checkpoint to resume ``source`` from: ``step``'s, else its newest, of those this API
    can read: in its store, or in its mount of the machines' shared directory (``FTQ_SHARED_DIR``),
    where a Slurm job's and a multi-machine job's checkpoints are written and never uploaded.

    Raises:
        Conflict: the job is not failed or cancelled, or has no checkpoint this API can read
            (the message says to mount the shared directory when its checkpoints are there).
        NotFound: no checkpoint at ``step`` (the message lists the steps there are).
    """
    if source.status not in RESUMABLE:
        raise Conflict(
            f"job {source.job_id} is {source.status}; only a failed or cancelled job can be resumed "
            f"(clone it instead: POST /v1/jobs/{source.job_id}/clone)",
            param="job_id",
        )
    recorded = service.list_checkpoints(session, source.job_id)
    checkpoints = [c for c in recorded if checkpoint_files(settings, c) is not None]
    unread = [c for c in recorded if c not in checkpoints and step in (None, c.step)
              and artifact_store.written_to_shared(c.path, c.job_id, c.step, source.output_dir)]
    if unread and (not checkpoints or step is not None):
        raise Conflict(_unmounted(source, unread[-1], settings), param="job_id" if step is None else "step")
    if not checkpoints:
        raise Conflict(
            f"job {source.job_id} has no checkpoint on disk to resume from; clone it to start over "
            "(and set checkpoint_every to keep checkpoints next time)",
            param="job_id",
        )
    if step is None:
        return checkpoints[-1]
    for checkpoint in checkpoints:
        if checkpoint.step == step:
            return checkpoint
    raise NotFound(
        f"job {source.job_id} has no checkpoint at step {step}; its checkpoints are at step "
        f"{', '.join(str(c.step) for c in checkpoints)}",
        param="step",
    )


def _unmounted(source: Job, checkpoint: Checkpoint, settings: Settings) -> str:
    """Why a checkpoint written to the machines' shared directory cannot be resumed from here."""
    where = ("this API host mounts no shared directory (FTQ_SHARED_DIR is unset)" if settings.shared_dir is None
             else f"it is not in this API host's FTQ_SHARED_DIR {settings.shared_dir} (another storage, or "
                  "mounted at another path)")
    return (f"job {source.job_id}'s checkpoint at step {checkpoint.step} was written to the shared checkpoint "
            f"directory of the machines that ran it ({checkpoint.path}) and never uploaded, and {where}; mount that "
            "directory on the API host at the same path and set FTQ_SHARED_DIR to it, then resume again")


def checkpoint_files(settings: Settings, checkpoint: Checkpoint) -> Path | None:
    """Where this API reads ``checkpoint``'s files: its store, else its mount of the shared
    directory (``artifact_store.shared_checkpoint_dir``: no links followed); None: neither."""
    store = artifact_store.checkpoint_store_dir(settings, checkpoint.job_id, checkpoint.step)
    if store.is_dir():
        return store
    return artifact_store.shared_checkpoint_dir(settings, checkpoint.job_id, checkpoint.step)


def seed_checkpoint(session: Session, job: Job, checkpoint: Checkpoint, *, settings: Settings) -> Path:
    """Link ``checkpoint``'s directory into ``job``'s checkpoints and record it there, so the
    worker keeps it (it sets aside checkpoints the store does not know) and the trainer resumes.

    A checkpoint in the store goes to the new job's store directory (a local worker's
    ``output_dir``; a remote worker downloads it). One in the shared directory goes to the new
    job's directory there, ``<FTQ_SHARED_DIR>/jobs/<new id>/``: the trainer's checkpoint home
    on a Slurm bridge and on machines of that storage (hard links on one filesystem, nothing
    copied), and the recorded path keeps the new job on that storage's machines
    (core/jobs/fewer_machines.py ``storage``).

    Raises:
        Conflict: the checkpoint's files went away since ``pick_checkpoint``.
    """
    source = checkpoint_files(settings, checkpoint)
    if source is None:
        raise Conflict(f"job {checkpoint.job_id}'s checkpoint at step {checkpoint.step} was removed meanwhile; "
                       "resume again to take another", param="step")
    if source == artifact_store.checkpoint_store_dir(settings, checkpoint.job_id, checkpoint.step):
        target = artifact_store.checkpoint_store_dir(settings, job.job_id, checkpoint.step)
    else:
        assert settings.shared_dir is not None  # checkpoint_files found it there
        target = layout.checkpoint_dir(artifact_store.shared_job_dir(settings.shared_dir, job.job_id), checkpoint.step)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, copy_function=_link_or_copy, dirs_exist_ok=True)
    session.add(Checkpoint(job_id=job.job_id, step=checkpoint.step, path=str(target), bytes=checkpoint.bytes,
                           final=False, created_at=utcnow()))
    return target


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed: a copy
        shutil.copy2(src, dst)


def resumed_spec(source: Job) -> JobSpec:
    """``source``'s stored spec, for a job that continues it.

    Raises:
        InvalidInput: the stored spec no longer validates (a rule added since).
    """
    try:
        return JobSpec.model_validate(source.spec)
    except ValueError as exc:
        raise InvalidInput(f"job {source.job_id}'s stored spec no longer validates ({exc}); clone it with "
                           "overrides that fix it", param="job_id") from exc


def in_project_of(spec: Spec, source: Job) -> Spec:
    """A clone, resume or re-queue goes to its source's project unless the spec names one."""
    return spec if spec.project or source.project_id is None else spec.model_copy(update={"project": source.project_id})
