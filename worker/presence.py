"""The worker's row in the ``worker`` table and its housekeeping loop.

At start the worker asks the trainer what it would run on (``python -m trainer detect --json``,
on the worker's GPUs) and stores the answer with its GPU pool (``gpu_slot`` rows), which ``GET /v1/hardware`` serves,
and which experiment trackers' packages it has (``"trackers"`` in the same report: the API refuses a
job asking for a tracker no live worker has, ``core.jobs.trackers``). Then,
every ``heartbeat_interval_s``, a background thread refreshes the row's ``heartbeat_at`` and runs
the reaper (reaper.py). The thread lives in the worker process beside the task threads, so
it keeps beating while jobs run.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import subprocess
import threading
from typing import Any

from sqlalchemy import select

from core.db import utcnow
from core.workers.models import Worker
from core.workers.pool import register_pool
from worker.reaper import reap
from worker.identity import identity
from worker.remote import may_claim
from worker.runtime import Runtime
from worker.tracking.resolve import installed as installed_trackers

log = logging.getLogger(__name__)


def detect_hardware(runtime: Runtime, timeout_s: float = 180.0) -> dict[str, Any]:
    """The trainer's ``detect --json`` output on this worker's GPU; ``{"error": ...}`` if it fails."""
    from worker.launch import trainer_env

    argv = [*runtime.options.trainer_argv, "detect", "--json"]
    try:
        done = subprocess.run(argv, env=trainer_env(runtime), capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{' '.join(argv)} did not run: {exc}"}
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", errors="replace").strip().splitlines()[-5:]
        return {"error": f"{' '.join(argv)} exited with {done.returncode}: " + " | ".join(tail)}
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        return {"error": f"{' '.join(argv)} printed no JSON: {exc}"}
    return report if isinstance(report, dict) else {"report": report}


def register(runtime: Runtime, hardware: dict[str, Any]) -> None:
    """Insert or refresh this worker's row and its GPU pool (the id is stable per host and GPUs)."""
    now = utcnow()
    with runtime.register_lock:
        with runtime.sessionmaker.begin() as session:
            row = session.execute(
                select(Worker).where(Worker.worker_id == runtime.worker_id).with_for_update()
            ).scalar_one_or_none()
            if row is None:
                row = Worker(worker_id=runtime.worker_id, started_at=now)
                session.add(row)
            row.hostname = socket.gethostname()
            row.device = _device(runtime, hardware)
            row.hardware = hardware
            row.current_job_id = runtime.current_job_id
            row.started_at = now
            row.heartbeat_at = now
            row.pool = runtime.options.pool_name
            for name, value in identity(session, runtime.settings).items():  # key_id, address
                setattr(row, name, value)
            session.flush()
            register_pool(session, runtime.worker_id, runtime.options.pool)
        runtime.mark_registered()


def _device(runtime: Runtime, hardware: dict[str, Any]) -> str:
    """``cuda:0,1`` for a worker given its GPUs; else what the trainer detected (a worker left
    unpinned on a GPU box trains on the first visible GPU, not on the CPU)."""
    if runtime.options.gpus:
        return runtime.options.device
    detected = hardware.get("hardware", {}).get("device") if isinstance(hardware.get("hardware"), dict) else None
    return str(detected) if detected else runtime.options.device


class Presence:
    """Registers the worker, then beats its heartbeat and runs the reaper until stopped."""

    def __init__(self, runtime: Runtime, *, detect: bool = True) -> None:
        self._runtime = runtime
        self._detect = detect
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftq-presence", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        runtime = self._runtime
        try:
            trackers = {"trackers": installed_trackers()}
            register(runtime, trackers if runtime.options.report is None else {**runtime.options.report(), **trackers})
            self.signal_own()
            if self._detect and runtime.options.report is None:
                register(runtime, {**detect_hardware(runtime), **trackers})
        except Exception:  # noqa: BLE001 - the worker still runs jobs without its row
            log.exception("could not register worker %s", runtime.worker_id)
        interval = runtime.settings.heartbeat_interval_s
        while not self._stopped.wait(interval * random.uniform(0.8, 1.2)):
            self.tick()

    def signal_own(self) -> None:
        """Once registered: wake this host for every queued job the policy now places on it (a
        job submitted while every host was busy got no message: api/jobs/wakeups.py)."""
        runtime = self._runtime
        reap(runtime.sessionmaker, runtime.settings, enqueue=runtime.enqueue, publish=runtime.publish,
             host=runtime.worker_id, resend_after_s=0.0)

    def tick(self) -> None:
        runtime = self._runtime
        try:
            register_heartbeat(runtime)
            reap(
                runtime.sessionmaker,
                runtime.settings,
                enqueue=runtime.enqueue,
                publish=runtime.publish,
                host=runtime.worker_id,
                resend_after_s=runtime.options.resend_queued_after_s,
            )
        except Exception:  # noqa: BLE001 - try again next interval
            log.exception("worker %s: housekeeping failed", runtime.worker_id)


def register_heartbeat(runtime: Runtime) -> None:
    """Beat the worker row, unless this is a remote worker whose key is revoked: it claims
    nothing (worker/remote.py ``may_claim``), so its machine must not look live either, or the
    placement would keep giving it jobs that wait for it (the GPUs page shows it lost)."""
    if not may_claim(runtime):
        return
    with runtime.sessionmaker.begin() as session:
        row = session.get(Worker, runtime.worker_id)
        if row is not None:
            row.heartbeat_at = utcnow()
            if runtime.options.report is not None:
                row.hardware = {**(row.hardware or {}), "error": None, **_fresh_report(runtime)}
            row.current_job_id = runtime.current_job_id


def _fresh_report(runtime: Runtime) -> dict[str, Any]:
    """The host's own report (a bridge's cluster view); a failure is stored as its error, beside
    the last report that worked."""
    assert runtime.options.report is not None
    try:
        return runtime.options.report()
    except Exception as exc:  # noqa: BLE001 - the heartbeat must go on; the GPUs page shows why
        log.warning("worker %s: could not refresh its report: %s", runtime.worker_id, exc)
        return {"error": f"the report could not be refreshed: {exc}"}
