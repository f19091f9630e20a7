"""What one worker process holds: settings, store, Redis, its identity and options.

Built in the pool process by ``worker_process_init`` (never at import and never before the
fork, so no connection is shared between processes) and passed to every task.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.db import make_engine, make_sessionmaker
from core.jobs import live
from core.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

    from core.jobs.models import Job
    from trainer.config import TrainConfig

log = logging.getLogger(__name__)


class ConfigBuilder(Protocol):
    """Turns a claimed job into the trainer's config (the default uses ``core.jobs.translate``)."""

    def __call__(self, session: Session, job: Job, *, settings: Settings, output_dir: str) -> TrainConfig: ...


class Event(Protocol):
    def is_set(self) -> bool: ...
    def set(self) -> None: ...


def _default_trainer_argv() -> tuple[str, ...]:
    return (sys.executable, "-m", "trainer")


@dataclass(frozen=True)
class WorkerOptions:
    gpu: str | None = None
    """``CUDA_VISIBLE_DEVICES`` for the trainer (one GPU index or UUID); None: CPU or inherited."""
    name: str | None = None
    """Worker id stored on the jobs it claims; default ``<hostname>/gpu<N>`` or ``<hostname>/cpu``."""
    trainer_argv: tuple[str, ...] = field(default_factory=_default_trainer_argv)
    """How to start the trainer CLI; ``run JOB.json`` or ``detect --json`` is appended."""
    max_batch_events: int = 200
    """Write buffered events as soon as this many wait, even before the flush interval."""
    stderr_tail_lines: int = 40
    """Lines of the trainer's stderr kept for a failed job's error message."""
    resend_queued_after_s: float = 120.0
    """An idle worker re-sends the message of a job queued longer than this (see reaper.py)."""

    def __post_init__(self) -> None:
        if self.max_batch_events < 1:
            raise ValueError(f"max_batch_events: must be >= 1, got {self.max_batch_events}")
        if self.stderr_tail_lines < 0:
            raise ValueError(f"stderr_tail_lines: must be >= 0, got {self.stderr_tail_lines}")
        if not self.trainer_argv:
            raise ValueError("trainer_argv: name the command that starts the trainer CLI")

    @property
    def worker_id(self) -> str:
        if self.name:
            return self.name
        host = socket.gethostname()
        return f"{host}/gpu{self.gpu}" if self.gpu is not None else f"{host}/cpu"

    @property
    def device(self) -> str:
        return f"cuda:{self.gpu}" if self.gpu is not None else "cpu"


class Runtime:
    """The store, Redis and broker handles of one worker process, and the job it is running."""

    def __init__(
        self,
        settings: Settings,
        options: WorkerOptions,
        *,
        engine: Engine,
        sessionmaker: sessionmaker[Session],
        redis: Any | None = None,
        celery: Celery | None = None,
        shutdown_event: Event | None = None,
        config_builder: ConfigBuilder | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.engine = engine
        self.sessionmaker = sessionmaker
        self.redis = redis
        self.celery = celery
        self.shutdown_event: Event = shutdown_event if shutdown_event is not None else threading.Event()
        self.config_builder: ConfigBuilder = config_builder or build_train_config
        self.current_job_id: str | None = None

    @classmethod
    def open(
        cls,
        settings: Settings,
        options: WorkerOptions,
        *,
        celery: Celery | None = None,
        shutdown_event: Event | None = None,
        config_builder: ConfigBuilder | None = None,
    ) -> Runtime:
        settings = settings.resolved()
        engine = make_engine(settings.database_url or "")
        redis = None
        if settings.redis_url:
            import redis as redis_lib

            redis = redis_lib.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
        return cls(
            settings,
            options,
            engine=engine,
            sessionmaker=make_sessionmaker(engine),
            redis=redis,
            celery=celery,
            shutdown_event=shutdown_event,
            config_builder=config_builder,
        )

    @property
    def worker_id(self) -> str:
        return self.options.worker_id

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        self.engine.dispose()

    def publish(self, job_id: str, seq: int) -> None:
        """Wake live viewers of ``job_id``; a lost message only delays them (they re-read the store)."""
        if self.redis is None or seq <= 0:
            return
        try:
            self.redis.publish(live.channel(job_id), live.message(seq))
        except Exception as exc:  # noqa: BLE001 - pub/sub is best effort by design (core/jobs/live.py)
            log.warning("could not publish events of %s to Redis: %s", job_id, exc)

    def enqueue(self, job_id: str) -> None:
        """Signal a waiting job again; call after the commit that made it ``queued``."""
        if self.celery is None:
            log.warning("job %s is queued but this runtime has no broker to signal it", job_id)
            return
        from core.queue import enqueue_job

        enqueue_job(self.celery, job_id)


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
    for file_id in (spec.training_file, spec.validation_file):
        if file_id and not (file_id in files and Path(files[file_id]).is_file()):
            raise InvalidInput(f"dataset {file_id} was deleted after the job was submitted; upload it again and resubmit")
    source = resolve_model(spec.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models)
    return to_train_config(spec, job_id=job.job_id, files=files, output_dir=output_dir, model_path=source.name_or_path)
