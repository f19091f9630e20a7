"""The worker's Celery app: the shared app from ``core.queue`` plus per-process set-up.

``create_worker_app`` builds the app in the worker's main process and connects the signals;
the store engine, Redis client and the presence thread are opened in the pool process by
``worker_process_init`` (after the fork, so no connection crosses processes) and closed by
``worker_process_shutdown``. When the main process is asked to shut down (Ctrl-C, SIGTERM),
``worker_shutting_down`` sets an event shared with the pool process: the running job's trainer
gets SIGTERM, writes a checkpoint, and the job goes back to the queue to resume later
instead of holding the shutdown for as long as training takes.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

from celery import Celery
from celery.signals import worker_process_init, worker_process_shutdown, worker_shutting_down

from core.queue import make_celery
from core.settings import Settings
from worker.presence import Presence
from worker.runtime import Runtime, WorkerOptions
from worker.tasks import register_tasks

log = logging.getLogger(__name__)


class _ProcessState:
    """The Runtime and presence thread of the current pool process (None until it starts)."""

    def __init__(self, settings: Settings, options: WorkerOptions, app: Celery) -> None:
        self.settings = settings
        self.options = options
        self.app = app
        self.shutdown = multiprocessing.get_context("fork").Event()
        self.runtime: Runtime | None = None
        self.presence: Presence | None = None

    def open(self, **_: Any) -> None:
        if self.runtime is not None:
            return
        self.runtime = Runtime.open(self.settings, self.options, celery=self.app, shutdown_event=self.shutdown)
        self.presence = Presence(self.runtime)
        self.presence.start()
        log.info("worker %s ready (device %s)", self.options.worker_id, self.options.device)

    def close(self, **_: Any) -> None:
        if self.presence is not None:
            self.presence.stop()
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = self.presence = None

    def shutting_down(self, **_: Any) -> None:
        self.shutdown.set()

    def get(self) -> Runtime:
        if self.runtime is None:
            self.open()  # solo/threads pools send no worker_process_init
        assert self.runtime is not None
        return self.runtime


def create_worker_app(settings: Settings, options: WorkerOptions) -> Celery:
    """The Celery app that runs jobs on this worker's GPU (``options.gpu``)."""
    settings = settings.resolved()
    app = make_celery(settings)
    state = _ProcessState(settings, options, app)
    register_tasks(app, state.get)
    worker_process_init.connect(state.open, weak=False)
    worker_process_shutdown.connect(state.close, weak=False)
    worker_shutting_down.connect(state.shutting_down, weak=False)
    app.ftq_state = state  # type: ignore[attr-defined]
    return app


def worker_argv(options: WorkerOptions, *, loglevel: str = "INFO") -> list[str]:
    """``celery worker`` arguments: one prefork process, prefetch 1, the ftq queue."""
    from core.queue import QUEUE

    return [
        "worker",
        "--pool=prefork",
        "--concurrency=1",
        "--prefetch-multiplier=1",
        f"--queues={QUEUE}",
        f"--hostname=ftq-{options.worker_id.replace('/', '-')}@%h",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
