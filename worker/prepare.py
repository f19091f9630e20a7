"""A claimed job's directory on this machine before its trainer starts.

    config      the stored spec → ``TrainConfig`` (``Runtime.config_builder``, by default
                ``build_train_config``) → job.json under <data_dir>/jobs/<job_id>/
    checkpoints on a retry, checkpoints newer than the store's newest are set aside, so the
                trainer resumes where the recorded metrics end (no gap)

The leader (worker/runner.py) and a multi-machine job's followers (worker/follower.py) both
prepare their directory this way.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from core.jobs.models import Checkpoint, Job
from core.jobs.service import append_events
from trainer.training import layout

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.settings import Settings
    from trainer.config import TrainConfig
    from trainer.generate.job_config import GenerateConfig
    from trainer.generate.session_config import SessionConfig
    from worker.claim import Claim
    from worker.runtime import Runtime

log = logging.getLogger(__name__)


def build_config(runtime: Runtime, session: Session, job: Job,
                 output_dir: Path) -> TrainConfig | GenerateConfig | SessionConfig:
    """The job's trainer config from the store: ``Runtime.config_builder``, by default
    ``build_train_config``, a generation job's ``GenerateConfig`` or a session's ``SessionConfig``
    (on a remote worker, their weights and prompts downloaded: worker/remote_generation.py);
    the caller saves it as job.json.

    Raises:
        Exception: whatever the builder raises (the spec no longer translates, a dataset
            download failed); the caller turns it into the job's outcome.
    """
    settings = runtime.settings
    fetch, files = None, None
    if settings.remote_worker and job.kind in ("generate", "eval", "session"):  # through the API
        from worker.remote_generation import prompts_fetcher, weights_fetcher

        fetch, files = weights_fetcher(settings), prompts_fetcher(settings)
    if job.kind in ("generate", "eval"):  # trainer.generate.job_config.GenerateConfig, an eval's EvalConfig
        from core.jobs.generation import build_generate_config

        return build_generate_config(session, job, settings=settings, output_dir=str(output_dir), fetch=fetch,
                                     files_for=files)
    if job.kind == "session":  # a chat session: trainer.generate.session_config.SessionConfig
        from core.sessions.service import build_session_config

        return build_session_config(session, job, settings=settings, output_dir=str(output_dir), fetch=fetch)
    builder = runtime.config_builder or build_train_config
    return builder(session, job, settings=runtime.settings, output_dir=str(output_dir))


def set_aside_unrecorded_checkpoints(runtime: Runtime, claim: Claim) -> list[str]:
    """Move checkpoints newer than the newest one in the store out of the trainer's way.

    A worker that died (SIGKILL, power cut) loses the events it had not yet written, while
    the trainer may have saved a checkpoint after them. Resuming from that checkpoint would
    leave a hole in the job's metrics. So a retry resumes from the newest checkpoint the store
    knows, and the trainer re-emits the steps after it; the newer directories are moved to
    ``<output_dir>/unrecorded-checkpoints/`` (kept, not deleted; in the shared directory for a
    job whose checkpoints are there, ``Claim.checkpoint_home``). Returns the names moved.
    """
    root = layout.checkpoints_dir(claim.checkpoint_home)
    if not root.is_dir():
        return []
    with runtime.sessionmaker() as session:
        recorded = session.execute(
            select(func.max(Checkpoint.step)).where(Checkpoint.job_id == claim.job_id)
        ).scalar_one_or_none() or 0
    moved = []
    for path in sorted(root.iterdir()):
        step = layout.parse_checkpoint_step(path.name)
        if step is not None and step > recorded:
            target = layout.unrecorded_checkpoints_dir(claim.checkpoint_home) / f"{path.name}-attempt{claim.attempt}"
            target.parent.mkdir(exist_ok=True)
            path.rename(target)
            moved.append(path.name)
    if moved:
        message = (f"checkpoints {', '.join(moved)} were written after the last stored event (the previous "
                   f"worker was lost); resuming from step {recorded} so the metrics have no gap")
        log.warning("job %s: %s", claim.job_id, message)
        with runtime.sessionmaker.begin() as session:
            (event,) = append_events(session, claim.job_id, [("log", {"level": "warning", "message": message})])
            seq = event.seq
        runtime.publish(claim.job_id, seq)
    return moved


def with_shared_home(config: TrainConfig | GenerateConfig | SessionConfig,
                     claim: Claim) -> TrainConfig | GenerateConfig | SessionConfig:
    """``config`` with ``shared_checkpoint_dir`` set to the claim's shared directory, when its
    machines share one (a training job's config; others are returned as they are)."""
    from trainer.config import TrainConfig

    if claim.shared_home is None or not isinstance(config, TrainConfig):
        return config
    return dataclasses.replace(config, shared_checkpoint_dir=str(claim.shared_home))


def build_train_config(session: Session, job: Job, *, settings: Settings, output_dir: str) -> TrainConfig:
    """The stored job spec → ``TrainConfig``, with dataset paths and the model resolved again.

    Raises:
        core.errors.InvalidInput: the spec no longer translates (a dataset was deleted, the
            model directory vanished); the job fails with the message.
    """
    from core.errors import InvalidInput
    from core.files.service import paths_for
    from core.jobs.model_source import resolve_model
    from core.jobs.spec import JobSpec
    from core.jobs.translate import to_train_config

    spec = JobSpec.model_validate(job.spec)
    files = paths_for(session, [spec.training_file, spec.validation_file])
    if settings.remote_worker:  # no shared disk: the datasets' cached downloads (worker/remote.py)
        from worker.remote import fetch_datasets

        files = fetch_datasets(session, settings, list(files))
    for file_id in (spec.training_file, spec.validation_file):
        if file_id and not (file_id in files and Path(files[file_id]).is_file()):
            raise InvalidInput(f"dataset {file_id} was deleted after the job was submitted; upload it again and resubmit")
    source = resolve_model(spec.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models)
    return to_train_config(spec, job_id=job.job_id, files=files, output_dir=output_dir, model_path=source.name_or_path)
