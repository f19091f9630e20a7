"""What one worker host holds: settings, store, Redis, its identity, its GPU pool and options.

One Celery worker per host runs a thread per GPU of its pool (worker/app.py); the Runtime is
built once in that process when the worker starts (never at import) and shared by the task
threads, which each run one job at a time.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from core.db import dispose_engine, make_engine, make_sessionmaker, utcnow
from core.jobs import live
from core.settings import Settings
from core.workers.models import Worker
from core.workers.pool import register_pool
from worker.identity import identity

if TYPE_CHECKING:
    from celery import Celery

    from core.jobs.models import Job
    from trainer.config import TrainConfig

log = logging.getLogger(__name__)


class ConfigBuilder(Protocol):
    """Turns a claimed job into the trainer's config (the default, worker/prepare.py, uses
    ``core.jobs.translate``)."""

    def __call__(self, session: Session, job: Job, *, settings: Settings, output_dir: str) -> TrainConfig: ...


class Event(Protocol):
    def is_set(self) -> bool: ...
    def set(self) -> None: ...


def _default_trainer_argv() -> tuple[str, ...]:
    return (sys.executable, "-m", "trainer")


def _default_torchrun_argv() -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run")


@dataclass(frozen=True)
class WorkerOptions:
    gpus: tuple[str, ...] = ()
    """The GPUs this worker host holds, as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs);
    a job gets ``CUDA_VISIBLE_DEVICES`` set to the ones it reserved. Empty: a pool of ``slots``
    CPU slots (CUDA_VISIBLE_DEVICES inherited)."""
    slots: int = 1
    """Without ``gpus``: how many "GPUs" the pool has; a job of N runs N ranks on the CPU (gloo)."""
    name: str | None = None
    """Worker id stored on the jobs it claims; default ``<hostname>/gpu<ids>`` or ``<hostname>/cpu``."""
    trainer_argv: tuple[str, ...] = field(default_factory=_default_trainer_argv)
    """How to start the trainer CLI; ``run JOB.json`` or ``detect --json`` is appended."""
    torchrun_argv: tuple[str, ...] = field(default_factory=_default_torchrun_argv)
    """How to start torchrun for a job of several GPUs (its options and the trainer follow)."""
    executor: str | None = None
    """The executor that runs every job of this host (worker/executors/: a scheduler's, say);
    None: each job's placement picks ``local``, ``torchrun`` or ``multi_machine``."""
    max_batch_events: int = 200
    """Write buffered events as soon as this many wait, even before the flush interval."""
    stderr_tail_lines: int = 40
    """Lines of the trainer's stderr kept for a failed job's error message."""
    resend_queued_after_s: float = 120.0
    """A host with free GPUs re-sends the message of a job placed on it but still queued after
    this long (see reaper.py)."""
    pool_name: str | None = None
    """The named pool this host serves (``worker.pool``: only jobs asking for it land here); None:
    an ordinary host. A Slurm bridge's (worker/slurm/bridge.py)."""
    report: Callable[[], dict[str, Any]] | None = None
    """What the host stores as its hardware report, read again at every heartbeat, instead of
    the trainer's ``detect`` (a bridge's: its partition and what the cluster reports now)."""

    def __post_init__(self) -> None:
        if self.max_batch_events < 1:
            raise ValueError(f"max_batch_events: must be >= 1, got {self.max_batch_events}")
        if self.stderr_tail_lines < 0:
            raise ValueError(f"stderr_tail_lines: must be >= 0, got {self.stderr_tail_lines}")
        if not self.trainer_argv:
            raise ValueError("trainer_argv: name the command that starts the trainer CLI")
        if not self.gpus and not 1 <= self.slots <= 1024:
            raise ValueError(f"slots: must be between 1 and 1024, got {self.slots}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus: {', '.join(self.gpus)} names a GPU twice")

    @property
    def pool(self) -> tuple[str | None, ...]:
        """Per slot of the pool, the GPU as CUDA_VISIBLE_DEVICES names it (None: a CPU slot)."""
        return tuple(self.gpus) if self.gpus else (None,) * self.slots

    @property
    def worker_id(self) -> str:
        if self.name:
            return self.name
        host = socket.gethostname()
        return f"{host}/gpu{','.join(self.gpus)}" if self.gpus else f"{host}/cpu"

    @property
    def device(self) -> str:
        return f"cuda:{','.join(self.gpus)}" if self.gpus else "cpu"


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
        self.config_builder: ConfigBuilder | None = config_builder
        """None: the stored spec's translation (worker/prepare.py ``build_train_config``)."""
        self.running: dict[str, int] = {}
        """Jobs this host runs now (job id → GPUs), one per busy task thread."""
        self._lock = threading.Lock()
        self.register_lock = threading.Lock()
        """Held while this host's row and pool are written (presence.register, ensure_registered)."""
        self._registered = False

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

    @property
    def current_job_id(self) -> str | None:
        """The job this host claimed last that still runs (None when idle)."""
        with self._lock:
            return next(reversed(self.running), None)

    def started(self, job_id: str, gpus: int) -> None:
        with self._lock:
            self.running[job_id] = gpus

    def ended(self, job_id: str) -> None:
        with self._lock:
            self.running.pop(job_id, None)

    def other_job(self, job_id: str) -> str | None:
        """The latest claimed job still running here other than ``job_id`` (None: none)."""
        with self._lock:
            return next((j for j in reversed(self.running) if j != job_id), None)

    def ensure_registered(self) -> None:
        """Give the store this host's row and GPU pool, once (presence.register does it at start;
        a claim before that, or without presence, must not find the host missing)."""
        with self.register_lock:
            if self._registered:
                return
            with self.sessionmaker.begin() as session:
                if session.get(Worker, self.worker_id) is None:
                    now = utcnow()
                    session.add(Worker(worker_id=self.worker_id, hostname=socket.gethostname(),
                                       device=self.options.device, hardware={}, started_at=now, heartbeat_at=now,
                                       pool=self.options.pool_name, **identity(session, self.settings)))
                    session.flush()
                register_pool(session, self.worker_id, self.options.pool)
            self._registered = True

    def mark_registered(self) -> None:
        """Called with ``register_lock`` held, after the row and the pool were written."""
        self._registered = True

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        dispose_engine(self.engine)  # a task or presence thread may still hold one

    def publish(self, job_id: str, seq: int) -> None:
        """Wake live viewers of ``job_id``; a lost message only delays them (they re-read the store)."""
        if self.redis is None or seq <= 0:
            return
        try:
            self.redis.publish(live.channel(job_id), live.message(seq))
        except Exception as exc:  # noqa: BLE001 - pub/sub is best effort by design (core/jobs/live.py)
            log.warning("could not publish events of %s to Redis: %s", job_id, exc)

    def enqueue(self, job_id: str, host: str | None = None) -> None:
        """Signal a waiting job to worker host ``host`` (None: any); call after the commit that
        made it ``queued``."""
        if self.celery is None:
            log.warning("job %s is queued but this runtime has no broker to signal it", job_id)
            return
        from core.queue import enqueue_job

        enqueue_job(self.celery, job_id, host)
