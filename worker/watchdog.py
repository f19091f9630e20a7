"""While a claimed job runs: its heartbeat, and the signals that stop its trainer.

The ``Watchdog`` thread beats the job's (and this worker row's) heartbeat and turns a cancel, a
worker shutdown or a lost claim into a signal to the job's executor (worker/executors/).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update

from core.db import utcnow
from core.jobs.models import Job
from core.jobs.states import JobStatus
from core.workers.models import Worker
from worker.executors.base import Signal
from worker.outcome import StopReason

if TYPE_CHECKING:
    from worker.claim import Claim
    from worker.executors.base import Executor
    from worker.runtime import Runtime

log = logging.getLogger(__name__)


def set_worker_job(session: Any, worker_id: str, job_id: str | None) -> None:
    """This worker row's current job (None: idle), and its heartbeat now."""
    session.execute(
        update(Worker)
        .where(Worker.worker_id == worker_id)
        .values(current_job_id=job_id, heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )


class Watchdog:
    """Beats the job's heartbeat and stops the trainer when it must stop.

    Every ``min(1 s, heartbeat_interval_s)`` it reads whether a cancel was asked for, the worker
    is shutting down, or the claim was lost. A cancel or a shutdown signals the executor
    ``Signal.stop`` (every rank checkpoints and exits) and, ``cancel_grace_s`` later,
    ``Signal.kill`` (every process of the job). A lost claim signals ``Signal.kill`` at once:
    another attempt may already use the output directory, so this trainer must not write a
    checkpoint there. A heartbeat that has not succeeded for
    ``LOST_AFTER`` of ``heartbeat_timeout_s`` (the store is unreachable) counts as lost too: the
    reaper will soon requeue the job, and the job must not run twice.
    """

    LOST_AFTER = 0.8

    def __init__(self, runtime: Runtime, claim: Claim, executor: Executor) -> None:
        self._runtime = runtime
        self._claim = claim
        self._executor = executor
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watchdog-{claim.job_id}", daemon=True)
        self._kill_at: float | None = None
        self._lock = threading.Lock()
        self._last_beat_ok = time.monotonic()
        self.stop_reason: StopReason | None = None

    def start(self) -> None:
        self._last_beat_ok = time.monotonic()
        self._thread.start()

    def lose(self, why: str) -> None:
        """Stop the trainer because the job is no longer ours: ``Signal.kill``, no checkpoint."""
        with self._lock:
            if self.stop_reason is StopReason.lost:
                return
            log.warning("job %s: stopping the trainer (lost: %s)", self._claim.job_id, why)
            self.stop_reason = StopReason.lost
            self._kill_at = None
        self._executor.signal(Signal.kill)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        settings = self._runtime.settings
        poll_s = min(1.0, settings.heartbeat_interval_s)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            try:
                if now >= next_beat:
                    reason = self._beat()
                    next_beat = now + settings.heartbeat_interval_s
                    self._last_beat_ok = time.monotonic()
                else:
                    reason = self._poll()
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not kill the watchdog
                log.warning("heartbeat of job %s failed: %s", self._claim.job_id, exc)
                reason = None
            silent_s = time.monotonic() - self._last_beat_ok
            if silent_s > self.LOST_AFTER * settings.heartbeat_timeout_s:
                self.lose(f"no successful heartbeat for {silent_s:.1f}s, the reaper may requeue it "
                          f"after heartbeat_timeout_s={settings.heartbeat_timeout_s:g}s")
            if reason is StopReason.lost:
                self.lose("the store says another worker or attempt holds it")
            elif reason is None and self._runtime.shutdown_event.is_set():
                reason = StopReason.shutdown
            if reason is not None and self.stop_reason is None:
                self._request_stop(reason)
            if self._kill_at is not None and time.monotonic() >= self._kill_at and self.stop_reason is not StopReason.lost:
                log.warning("job %s: trainer still running %gs after SIGTERM; killing all its processes",
                            self._claim.job_id, settings.cancel_grace_s)
                self._executor.signal(Signal.kill)
                self._kill_at = None
            if self._stopped.wait(poll_s):
                return

    def _request_stop(self, reason: StopReason) -> None:
        with self._lock:
            if self.stop_reason is not None:
                return
            self.stop_reason = reason
        log.info("job %s: stopping the trainer (%s)", self._claim.job_id, reason.value)
        self._executor.signal(Signal.stop)
        self._kill_at = time.monotonic() + self._runtime.settings.cancel_grace_s

    def _mine(self) -> Any:
        return (
            (Job.job_id == self._claim.job_id)
            & (Job.status == JobStatus.running.value)
            & (Job.worker_id == self._runtime.worker_id)
            & (Job.attempts == self._claim.attempt)
        )

    def _beat(self) -> StopReason | None:
        now = utcnow()
        with self._runtime.sessionmaker.begin() as session:
            owned = session.execute(
                update(Job).where(self._mine()).values(heartbeat_at=now).execution_options(synchronize_session=False)
            ).rowcount == 1
            set_worker_job(session, self._runtime.worker_id, self._runtime.current_job_id)
            cancel = session.execute(
                select(Job.cancel_requested).where(Job.job_id == self._claim.job_id)
            ).scalar_one_or_none()
        return _reason(owned, bool(cancel))

    def _poll(self) -> StopReason | None:
        with self._runtime.sessionmaker() as session:
            row = session.execute(
                select(Job.cancel_requested, self._mine().label("owned")).where(Job.job_id == self._claim.job_id)
            ).one_or_none()
        if row is None:
            return StopReason.lost
        return _reason(bool(row.owned), bool(row.cancel_requested))


def _reason(owned: bool, cancel: bool) -> StopReason | None:
    if not owned:
        return StopReason.lost
    if cancel:
        return StopReason.cancel
    return None
