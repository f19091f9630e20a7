"""One job on this worker host, from claim to final state (one task thread per job).

    claim     the job the queue policy places on this host now and its GPUs, reserved all or
              none with it (core/jobs/scheduling.py), queued → running by compare-and-set (a
              redelivered message finds it taken)
    config    the stored spec → job.json under <data_dir>/jobs/<job_id>/; on a retry,
              checkpoints newer than the store's newest are set aside (no metrics gap)
    run       the trainer (1 GPU) or torchrun over one rank per GPU (launch.py), pinned to the
              job's GPUs, in its own process group; events batched into the store; a watchdog
              thread beats the heartbeat and turns a cancel, a worker shutdown or a lost claim
              into SIGTERM to the trainer (every rank), then SIGKILL to every process of the
              job after cancel_grace_s (a lost claim: SIGKILL at once)
    finish    every process of the job is killed whatever happened (process.py); the exit
              becomes the job's state (outcome.py) and the same transaction frees its GPUs; a
              job handed back by a shutdown is queued again and re-sent; then every job that
              can start now is signalled to its host
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update

from core.db import utcnow
from core.jobs import scheduling
from core.jobs.models import Checkpoint, Job
from core.jobs.service import append_events, state_event, transition
from core.jobs.states import JobStatus
from core.workers.models import GpuSlot, Worker
from trainer.training import layout
from worker import nodes, remote
from worker.outcome import Outcome, StopReason, classify
from worker.launch import Rendezvous, launch_argv, run_tag
from worker.process import TrainerExit, TrainerProcess
from worker.recorder import EventRecorder
from worker.tracking.resolve import tracking_for, without_credentials
from worker.runtime import Runtime

log = logging.getLogger(__name__)

_SECRET_ENV = ("FTQ_DATABASE_URL", "FTQ_BROKER_URL", "FTQ_REDIS_URL", "FTQ_WORKER_KEY")
_PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Claim:
    job_id: str
    attempt: int
    output_dir: Path
    slots: tuple[int, ...] = (0,)
    """The slots of this host's pool the job holds."""
    devices: tuple[str | None, ...] = (None,)
    """Those slots' GPUs as CUDA_VISIBLE_DEVICES names them (None: CPU slots)."""
    rendezvous: Rendezvous | None = None  # a multi-machine job's, on its leader (worker/nodes.py)

    @property
    def gpus(self) -> int:
        return len(self.slots)


def run_job(runtime: Runtime, job_id: str) -> str:
    """Claim the next eligible job and run it; ``job_id`` is only the message that woke us.

    The store decides what runs (core/jobs/scheduling.py): the claimed job may be another one
    than ``job_id`` (higher priority, older, or ``job_id`` is someone else's already), or none.
    Safe to call twice: a redelivered message claims the next job or nothing.

    Returns the claimed job's status after this call; ``skipped`` when nothing was eligible;
    ``deferred`` when the worker is shutting down (the task puts the message back).
    """
    if runtime.shutdown_event.is_set():
        log.info("not starting job %s: this worker is shutting down", job_id)
        return "deferred"
    claim = claim_next_job(runtime, signalled=job_id)
    if claim is None:
        return "skipped"
    runtime.started(claim.job_id, claim.gpus)
    try:
        try:
            with remote.beating(runtime, claim):  # a remote worker's transfers outlast the watchdog
                outcome, done = _run_claimed(runtime, claim)
        except Exception as exc:  # noqa: BLE001 - a claimed job must not stay running until reaped
            log.exception("job %s: the worker failed before the trainer could run", claim.job_id)
            outcome, done = remote.run_failed(exc, claim.attempt, runtime.settings.max_attempts), None
        return finish_job(runtime, claim, outcome, done)
    finally:
        runtime.ended(claim.job_id)


MAX_CLAIM_TRIES = 8
"""Claims lost to other workers before giving up on this message (each try re-reads the queue)."""


def claim_next_job(runtime: Runtime, *, signalled: str | None = None) -> Claim | None:
    """queued → running for the job the policy places on this host now, with its GPUs reserved;
    None if nothing is placed here.

    Each try is its own transaction: the placement (scheduling.next_placement), then the claim
    (scheduling.try_claim: the GPUs all or none, then the job). A try lost to another claimant
    (the job or one of its GPUs taken, the owner's cap filled meanwhile) rolls back and places again.
    """
    runtime.ensure_registered()
    if not remote.may_claim(runtime):
        return None
    for attempt in range(MAX_CLAIM_TRIES):
        with runtime.sessionmaker() as session:
            placement = scheduling.next_placement(session, runtime.settings, runtime.worker_id)
            if placement is None:
                log.info("message for %s: no queued job can start on this host now", signalled)
                return None
            job_id = placement.job_id
            output_dir = runtime.settings.jobs_dir / job_id
            won = scheduling.try_claim(
                session,
                placement,
                runtime.settings,
                values={
                    "worker_id": runtime.worker_id,
                    "attempts": Job.attempts + 1,
                    "heartbeat_at": utcnow(),
                    "output_dir": str(output_dir),
                    "error_code": None,
                    "error_message": None,
                },
            )
            if not won:
                session.rollback()
                log.info("job %s or its GPUs were claimed, cancelled or capped meanwhile; placing again", job_id)
                time.sleep(random.uniform(0, 0.05 * (attempt + 1)))
                continue
            attempt_no = session.execute(select(Job.attempts).where(Job.job_id == job_id)).scalar_one()
            devices = tuple(
                session.execute(
                    select(GpuSlot.device)
                    .where(GpuSlot.worker_id == runtime.worker_id, GpuSlot.slot.in_(placement.slots))
                    .order_by(GpuSlot.slot)
                ).scalars()
            )
            (event,) = append_events(session, job_id, [state_event(
                JobStatus.running, worker_id=runtime.worker_id, attempt=attempt_no, slots=list(placement.slots),
            )])
            rendezvous = nodes.record_parts(session, runtime.settings, placement, attempt_no)
            _set_worker_job(session, runtime.worker_id, job_id)
            seq = event.seq
            session.commit()
        runtime.publish(job_id, seq)
        nodes.send_followers(runtime, job_id, attempt_no)
        via = "" if signalled in (None, job_id) else f" (woken by the message for {signalled})"
        log.info("claimed job %s on slots %s (attempt %d)%s", job_id, list(placement.slots), attempt_no, via)
        return Claim(job_id=job_id, attempt=attempt_no, output_dir=output_dir, slots=placement.slots, devices=devices, rendezvous=rendezvous)
    log.warning("message for %s: lost %d claims in a row to other claimants; leaving the rest to them",
                signalled, MAX_CLAIM_TRIES)
    return None


def _run_claimed(runtime: Runtime, claim: Claim) -> tuple[Outcome, dict[str, Any] | None]:
    claim.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        with runtime.sessionmaker() as session:
            job = session.get(Job, claim.job_id)
            assert job is not None, f"job {claim.job_id} vanished after it was claimed"
            config = runtime.config_builder(session, job, settings=runtime.settings, output_dir=str(claim.output_dir))
    except Exception as exc:  # noqa: BLE001 - a spec that no longer translates fails; a transfer retries
        log.warning("job %s: cannot build the trainer config: %s", claim.job_id, exc)
        return remote.not_prepared(exc, claim.attempt, runtime.settings.max_attempts), None
    job_json = claim.output_dir / "job.json"
    config.save(job_json)
    set_aside_unrecorded_checkpoints(runtime, claim)

    settings = runtime.settings
    recorder = EventRecorder(
        runtime.sessionmaker,
        claim.job_id,
        flush_interval_s=settings.event_flush_interval_s,
        max_batch=runtime.options.max_batch_events,
        publish=runtime.publish,
        worker_id=runtime.worker_id,
        attempt=claim.attempt,
    )
    outputs = remote.job_outputs(runtime, claim, recorder)  # a remote worker's uploads (worker/remote.py)
    done: list[dict[str, Any]] = []
    tracking = tracking_for(runtime, claim.job_id, claim.output_dir)  # a background thread: never waited on

    def on_event(event: dict[str, Any]) -> None:
        tracking.add(event)
        if event["type"] == "done":
            done.append(event)
        else:
            outputs.add(event)

    rank_logs = claim.output_dir / "ranks" / f"attempt-{claim.attempt}"
    trainer = TrainerProcess(
        launch_argv(runtime.options, job_json, ranks=claim.gpus, rank_log_dir=rank_logs, rendezvous=claim.rendezvous),
        on_event=on_event,
        env=nodes.pin_interface(trainer_env(runtime, claim.devices), claim.rendezvous),
        cwd=claim.output_dir,
        stderr_path=claim.output_dir / "trainer.stderr.log",
        tail_lines=runtime.options.stderr_tail_lines,
        tag=run_tag(runtime.worker_id, claim.job_id, claim.attempt),
        ranks=claim.gpus,
        rank_log_dir=rank_logs,
    )
    watchdog = Watchdog(runtime, claim, trainer)
    parts = nodes.watch_parts(runtime, claim.job_id, claim.attempt, trainer, claim.rendezvous)  # other machines
    error: Exception | None = None
    try:
        trainer.start()
        watchdog.start()
        parts.start()
        while not trainer.has_exited():
            recorder.wait(timeout=0.2)
            _flush(recorder, only_if_due=True)
            if recorder.lost:
                watchdog.lose("its events were refused: the job is another claim's now")
    except Exception as exc:  # noqa: BLE001 - our own failure still ends the trainer and the job
        log.exception("job %s: the worker failed while running the trainer", claim.job_id)
        error = exc
    finally:
        watchdog.stop()
        parts.stop()
        exit_ = trainer.finish() if _started(trainer) else TrainerExit(returncode=-1, stderr_tail=(), world_size=claim.gpus)
        outputs.drain()
        _flush(recorder, only_if_due=False, attempts=5)
    if error is not None:
        tracking.finish(JobStatus.failed.value)
        return Outcome(JobStatus.failed, "worker_error", f"the worker failed while running the trainer: {error!r}"), None
    last_done = done[-1] if done else None
    outcome = classify(
        exit_, last_done, watchdog.stop_reason, cancel_grace_s=settings.cancel_grace_s,
        attempt=claim.attempt, max_attempts=settings.max_attempts,
    )
    outcome = outputs.finish(parts.settle(outcome, max_attempts=settings.max_attempts))
    tracking.finish(outcome.status.value if outcome.status else "lost")
    return outcome, last_done


def set_aside_unrecorded_checkpoints(runtime: Runtime, claim: Claim) -> list[str]:
    """Move checkpoints newer than the newest one in the store out of the trainer's way.

    A worker that died (SIGKILL, power cut) loses the events it had not yet written, while
    the trainer may have saved a checkpoint after them. Resuming from that checkpoint would
    leave a hole in the job's metrics. So a retry resumes from the newest checkpoint the store
    knows, and the trainer re-emits the steps after it; the newer directories are moved to
    ``<output_dir>/unrecorded-checkpoints/`` (kept, not deleted). Returns the names moved.
    """
    root = layout.checkpoints_dir(claim.output_dir)
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
            target = layout.unrecorded_checkpoints_dir(claim.output_dir) / f"{path.name}-attempt{claim.attempt}"
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


def _started(trainer: TrainerProcess) -> bool:
    try:
        trainer.pid
    except RuntimeError:
        return False
    return True


def _flush(recorder: EventRecorder, *, only_if_due: bool, attempts: int = 1) -> None:
    for attempt in range(attempts):
        try:
            recorder.flush_if_due() if only_if_due else recorder.flush()
            return
        except Exception as exc:  # noqa: BLE001 - the events stay buffered and are written next time
            log.warning("could not write events of %s (attempt %d): %s", recorder.job_id, attempt + 1, exc)
            time.sleep(min(2.0, 0.2 * 2**attempt))


def finish_job(runtime: Runtime, claim: Claim, outcome: Outcome, done: dict[str, Any] | None) -> str:
    """Apply ``outcome`` if the job is still this claim's; returns the job's status afterwards."""
    job_id = claim.job_id
    with runtime.sessionmaker.begin() as session:
        row = session.execute(
            select(Job.status, Job.worker_id, Job.attempts).where(Job.job_id == job_id).with_for_update()
        ).one()
        _set_worker_job(session, runtime.worker_id, runtime.other_job(job_id))
        ours = row.status == JobStatus.running.value and row.worker_id == runtime.worker_id and row.attempts == claim.attempt
        if outcome.status is None or not ours:
            log.warning("job %s is %s under %s now; leaving it as it is", job_id, row.status, row.worker_id)
            return row.status
        target = outcome.status
        values: dict[str, Any]
        if target is JobStatus.queued:
            # A hand-back on shutdown is no failed attempt: it must not use up max_attempts (a
            # retry after an unexplained kill is one, outcome.retry).
            values = {"worker_id": None, "heartbeat_at": None, "attempts": Job.attempts - (0 if outcome.retry else 1)}
        else:
            values = {"error_code": outcome.error_code, "error_message": outcome.message if target is JobStatus.failed else None}
        transition(session, job_id, target, only_from=[JobStatus.running], **values)
        detail: dict[str, Any] = {"error_code": outcome.error_code, "message": outcome.message}
        if done is not None:
            detail.update(adapter_path=done.get("adapter_path"), steps=done.get("steps"))
        (event,) = append_events(session, job_id, [state_event(target, **detail)])
        seq = event.seq
    runtime.publish(job_id, seq)
    if target is JobStatus.queued:
        runtime.enqueue(job_id)
    else:
        signal_waiting(runtime)
    log.info("job %s → %s%s", job_id, target.value, f" ({outcome.error_code})" if outcome.error_code else "")
    return target.value


def signal_waiting(runtime: Runtime) -> list[str]:
    """Send ``jobs.run`` to the host of each job that can start now, after this host's job ended.

    A message may have been dropped earlier by a host that could not place the job (its owner
    at the cap, not enough free GPUs), so the GPUs this job freed must wake whoever can use them
    now. A duplicate message is harmless. Best effort: the reaper's periodic re-send covers a
    failure here.
    """
    try:
        with runtime.sessionmaker() as session:
            targets = scheduling.signal_targets(session, runtime.settings)
        for placement in targets:
            runtime.enqueue(placement.job_id, placement.worker_id)
    except Exception as exc:  # noqa: BLE001 - the job's own outcome is stored already
        log.warning("could not signal the waiting jobs: %s", exc)
        return []
    return [placement.job_id for placement in targets]


def trainer_env(runtime: Runtime, devices: tuple[str | None, ...] | None = None) -> dict[str, str]:
    """The worker's environment without the service's connection URLs, pinned to ``devices``
    (a job's reserved GPUs; None: all of the host's) by ``CUDA_VISIBLE_DEVICES``. CPU slots
    leave it as the worker inherited it."""
    env = without_credentials({k: v for k, v in os.environ.items() if k not in _SECRET_ENV}, runtime.settings)
    env["PYTHONUNBUFFERED"] = "1"
    gpus = [d for d in (runtime.options.pool if devices is None else devices) if d is not None]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if (_PROJECT_ROOT / "trainer").is_dir():
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{_PROJECT_ROOT}{os.pathsep}{path}" if path else str(_PROJECT_ROOT)
    return env


def _set_worker_job(session: Any, worker_id: str, job_id: str | None) -> None:
    session.execute(
        update(Worker)
        .where(Worker.worker_id == worker_id)
        .values(current_job_id=job_id, heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )


class Watchdog:
    """Beats the job's heartbeat and stops the trainer when it must stop.

    Every ``min(1 s, heartbeat_interval_s)`` it reads whether a cancel was asked for, the worker
    is shutting down, or the claim was lost. A cancel or a shutdown sends SIGTERM to the
    trainer (to every rank under torchrun: it checkpoints and exits) and, ``cancel_grace_s``
    later, SIGKILL to every process of the job. A lost claim sends SIGKILL at once: another attempt may already use the output directory, so this
    trainer must not write a checkpoint there. A heartbeat that has not succeeded for
    ``LOST_AFTER`` of ``heartbeat_timeout_s`` (the store is unreachable) counts as lost too: the
    reaper will soon requeue the job, and the job must not run twice.
    """

    LOST_AFTER = 0.8

    def __init__(self, runtime: Runtime, claim: Claim, trainer: TrainerProcess) -> None:
        self._runtime = runtime
        self._claim = claim
        self._trainer = trainer
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
        """Stop the trainer because the job is no longer ours: SIGKILL to its group, no checkpoint."""
        with self._lock:
            if self.stop_reason is StopReason.lost:
                return
            log.warning("job %s: stopping the trainer (lost: %s)", self._claim.job_id, why)
            self.stop_reason = StopReason.lost
            self._kill_at = None
        self._trainer.kill()

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
                self._trainer.kill()
                self._kill_at = None
            if self._stopped.wait(poll_s):
                return

    def _request_stop(self, reason: StopReason) -> None:
        with self._lock:
            if self.stop_reason is not None:
                return
            self.stop_reason = reason
        log.info("job %s: stopping the trainer (%s)", self._claim.job_id, reason.value)
        self._trainer.terminate()
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
            _set_worker_job(session, self._runtime.worker_id, self._runtime.current_job_id)
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
