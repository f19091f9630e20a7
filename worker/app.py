"""The worker's Celery app: one worker per host, holding the host's GPUs as one pool.

The worker runs Celery's ``threads`` pool with one thread per GPU of its pool and one for
exports (concurrency = GPU count + 1; worker/exports.py runs one export at a time), consuming the
shared queue and its own host queue (core/queue.py). Each ``jobs.run``
takes a thread: it claims the job the policy places on this host and the GPUs it needs
(core/jobs/scheduling.py), then runs it (one process, or torchrun over N ranks) until it ends.
A job holds at least one GPU, so a free GPU always has a free thread.

``create_worker_app`` builds the app and connects the signals; the store engine, Redis client
and the presence thread are opened once in the worker process when it is ready
(``worker_ready``; a task arriving first opens them) and closed at ``worker_shutdown``.
Before that it kills what an earlier run of this worker left (``kill_leftovers``). When the
worker is asked to shut down (Ctrl-C, SIGTERM), ``worker_shutting_down`` sets an
event the running jobs watch: each trainer gets SIGTERM, writes a checkpoint, and its job goes
back to the queue to resume later instead of holding the shutdown for as long as training takes.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down
from sqlalchemy import select

from core.jobs.models import Job
from core.queue import make_celery
from core.settings import Settings
from worker.launch import worker_host_tag
from worker.presence import Presence
from worker.process import signal_pids, tags_of
from worker.runtime import Runtime, WorkerOptions
from worker.tasks import register_tasks

log = logging.getLogger(__name__)


class _ProcessState:
    """The worker's Runtime and presence thread (None until the worker is ready)."""

    def __init__(self, settings: Settings, options: WorkerOptions, app: Celery) -> None:
        self.settings = settings
        self.options = options
        self.app = app
        self.shutdown = threading.Event()
        self.runtime: Runtime | None = None
        self.presence: Presence | None = None
        self._lock = threading.Lock()

    def open(self, **_: Any) -> None:
        with self._lock:
            if self.runtime is not None:
                return
            runtime = Runtime.open(self.settings, self.options, celery=self.app, shutdown_event=self.shutdown)
            kill_leftovers(runtime)
            self.runtime = runtime
            self.presence = Presence(self.runtime)
            self.presence.start()
        log.info("worker %s ready (%d GPU%s: %s)", self.options.worker_id, len(self.options.pool),
                 "s" if len(self.options.pool) != 1 else "", self.options.device)

    def close(self, **_: Any) -> None:
        with self._lock:
            if self.presence is not None:
                self.presence.stop()
            if self.runtime is not None:
                self.runtime.close()
            self.runtime = self.presence = None

    def shutting_down(self, **_: Any) -> None:
        self.shutdown.set()

    def get(self) -> Runtime:
        if self.runtime is None:
            self.open()  # a task before worker_ready
        assert self.runtime is not None
        return self.runtime


def kill_leftovers(runtime: Runtime) -> list[int]:
    """SIGKILL processes an earlier run of this worker started and left (it was itself killed:
    ranks live in sessions of their own and survive it, holding GPU memory). Runs before this
    worker starts any job, so every process tagged with its id and a job of its store is a
    leftover. (The store check spares another install on the same machine that happens to use
    the same worker id: its job ids are not in this store.)"""
    prefix = worker_host_tag(runtime.worker_id)
    found = tags_of(prefix)
    if not found:
        return []
    jobs = {pid: tag.rsplit("|", 2)[-2] for pid, tag in found.items() if tag.count("|") >= 2}
    with runtime.sessionmaker() as session:
        ours = set(session.scalars(select(Job.job_id).where(Job.job_id.in_(set(jobs.values())))))
    killed = [pid for pid, job_id in jobs.items() if job_id in ours]
    if killed:
        log.warning("killing %d processes left by an earlier run of worker %s: %s", len(killed), runtime.worker_id, killed)
    left, deadline = killed, time.monotonic() + 10
    while left and time.monotonic() < deadline:
        signal_pids(left, signal.SIGKILL, tag=prefix)
        time.sleep(0.05)
        alive = tags_of(prefix)
        left = [pid for pid in left if pid in alive]
    return killed


def create_worker_app(settings: Settings, options: WorkerOptions) -> Celery:
    """The Celery app that runs jobs on this host's GPUs (``options.pool``)."""
    settings = settings.resolved()
    app = make_celery(settings)
    state = _ProcessState(settings, options, app)
    register_tasks(app, state.get)
    worker_ready.connect(state.open, weak=False)
    worker_shutdown.connect(state.close, weak=False)
    worker_shutting_down.connect(state.shutting_down, weak=False)
    app.ftq_state = state  # type: ignore[attr-defined]
    return app


def worker_argv(options: WorkerOptions, *, loglevel: str = "INFO") -> list[str]:
    """``celery worker`` arguments: a thread per GPU of the pool and one for exports
    (worker/exports.py), prefetch 1 per thread, the shared ftq queue and this host's own."""
    from core.queue import QUEUE, host_queue

    return [
        "worker",
        "--pool=threads",
        f"--concurrency={len(options.pool) + 1}",
        "--prefetch-multiplier=1",
        f"--queues={QUEUE},{host_queue(options.worker_id)}",
        f"--hostname=ftq-{re.sub(r'[^A-Za-z0-9_.-]+', '-', options.worker_id)}@%h",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
