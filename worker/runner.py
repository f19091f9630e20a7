"""One job on this worker host, from claim to final state (one task thread per job).

    claim     the job the queue policy places on this host now and its GPUs, reserved all or
              none with it (core/jobs/scheduling.py), queued → running by compare-and-set (a
              redelivered message finds it taken)
    config    the stored spec → job.json under <data_dir>/jobs/<job_id>/; on a retry,
              checkpoints newer than the store's newest are set aside (no metrics gap; prepare.py)
    run       the executor the placement picks (worker/executors/: the trainer alone, torchrun
              over this host's GPUs, or this machine's ranks of a multi-machine job) starts the
              trainer; its events are batched into the store; a watchdog thread (watchdog.py)
              beats the heartbeat and turns a cancel, a worker shutdown or a lost claim into
              ``Signal.stop`` (every rank checkpoints), then ``Signal.kill`` after
              cancel_grace_s (a lost claim: ``Signal.kill`` at once)
    finish    the executor collects the run whatever happened (every process of the job is
              killed); the exit becomes the job's state (outcome.py), which the executor may
              settle (a lost machine: a retry), and the same transaction frees its GPUs; a
              job handed back by a shutdown is queued again and re-sent; then every job that
              can start now is signalled to its host
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from core.db import utcnow
from core.jobs import scheduling
from core.jobs.models import Job
from core.jobs.service import append_events, state_event, transition
from core.jobs.states import JobStatus
from core.workers.models import GpuSlot
from worker import executors, remote
from worker.claim import Claim
from worker.nodes import record_alone
from worker.executors import Executor, OnEvent
from worker.outcome import Outcome, classify
from worker.prepare import build_config, set_aside_unrecorded_checkpoints, with_shared_home
from worker.process import TrainerExit
from worker.recorder import EventRecorder
from worker.session_relay import relay_for
from worker.shared_storage import claim_home
from worker.runtime import Runtime
from worker.tracking.resolve import tracking_for
from worker.watchdog import Watchdog, set_worker_job

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.jobs.placement import Placement

log = logging.getLogger(__name__)

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
    (scheduling.try_claim: the GPUs all or none, then the job, then what the placement's executor
    reserves besides). A try lost to another claimant (the job or one of its GPUs taken, the
    owner's cap filled meanwhile) rolls back and places again.
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
            executor = executors.choose(runtime.options, placement)
            output_dir = runtime.settings.jobs_dir / placement.job_id
            won = scheduling.try_claim(session, placement, runtime.settings, values={
                "worker_id": runtime.worker_id, "attempts": Job.attempts + 1, "heartbeat_at": utcnow(),
                "output_dir": str(output_dir), "error_code": None, "error_message": None,
            })
            if not won:
                session.rollback()
                log.info("job %s or its GPUs were claimed, cancelled or capped meanwhile; placing again",
                         placement.job_id)
                time.sleep(random.uniform(0, 0.05 * (attempt + 1)))
                continue
            claim, seq = _record_claim(session, runtime, placement, executor, output_dir)
            session.commit()
        runtime.publish(claim.job_id, seq)
        executors.get(executor).announce(runtime, claim.job_id, claim.attempt)
        via = "" if signalled in (None, claim.job_id) else f" (woken by the message for {signalled})"
        log.info("claimed job %s on slots %s (attempt %d, %s)%s", claim.job_id, list(claim.slots), claim.attempt,
                 executor, via)
        return claim
    log.warning("message for %s: lost %d claims in a row to other claimants; leaving the rest to them",
                signalled, MAX_CLAIM_TRIES)
    return None


def _record_claim(session: Session, runtime: Runtime, placement: Placement, executor: str,
                  output_dir: Path) -> tuple[Claim, int]:
    """In a won claim's transaction: the ``running`` event, what the executor reserves, this
    worker row's job; the claim and the event's seq."""
    job_id = placement.job_id
    attempt = session.execute(select(Job.attempts).where(Job.job_id == job_id)).scalar_one()
    devices = tuple(session.scalars(
        select(GpuSlot.device)
        .where(GpuSlot.worker_id == runtime.worker_id, GpuSlot.slot.in_(placement.slots))
        .order_by(GpuSlot.slot)
    ))
    (event,) = append_events(session, job_id, [state_event(
        JobStatus.running, worker_id=runtime.worker_id, attempt=attempt, slots=list(placement.slots),
    )])
    rendezvous = executors.get(executor).reserve(session, runtime.settings, placement, attempt)
    set_worker_job(session, runtime.worker_id, job_id)
    job = session.execute(select(Job.nodes, Job.pool).where(Job.job_id == job_id)).one()
    machines = 1 if job.pool else job.nodes or 1
    shared = (claim_home(session, job_id, attempt, runtime.worker_id, parts=len(placement.parts)) if machines > 1
              else executors.get(executor).shared_home(job_id))
    if len(placement.parts) < machines:  # a retry placed on fewer machines (core/jobs/placement.py ``fewer``)
        if len(placement.parts) == 1:  # its one machine's job_node row (several: the executor wrote theirs)
            record_alone(session, placement, attempt)
        (event,) = append_events(session, job_id, [("log", _fewer_machines(placement, machines, shared))])
    claim = Claim(job_id=job_id, attempt=attempt, output_dir=output_dir, slots=placement.slots, devices=devices,
                  rendezvous=rendezvous, executor=executor, shared_home=shared)
    return claim, event.seq


def _fewer_machines(placement: Placement, machines: int, shared: Path | None) -> dict[str, Any]:
    """The ``log`` event of an attempt that resumes on fewer machines than the job asked for."""
    where = ", ".join(part.worker_id for part in placement.parts)
    return {"level": "warning", "machines": len(placement.parts), "nodes": machines, "message": (
        f"resumed on {len(placement.parts)} of {machines} machines ({where}): the others are not live; the same "
        f"global batch, {len(placement.slots)} GPU(s) on each, from the newest checkpoint"
        + (f" in the shared directory {shared}" if shared is not None else "")
        + "; it stays on these machines until it ends (a later retry may use all of them again)")}


def _run_claimed(runtime: Runtime, claim: Claim) -> tuple[Outcome, dict[str, Any] | None]:
    """Prepare the job's directory, run its executor's lifecycle while recording its events,
    and judge the exit; the outcome and the trainer's ``done`` event (None: none came)."""
    claim.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        with runtime.sessionmaker() as session:
            job = session.get(Job, claim.job_id)
            assert job is not None, f"job {claim.job_id} vanished after it was claimed"
            config = with_shared_home(build_config(runtime, session, job, claim.output_dir), claim)
    except Exception as exc:  # noqa: BLE001 - a spec that no longer translates fails; a transfer retries
        log.warning("job %s: cannot build the trainer config: %s", claim.job_id, exc)
        return remote.not_prepared(exc, claim.attempt, runtime.settings.max_attempts), None
    job_json = claim.output_dir / "job.json"
    config.save(job_json)
    set_aside_unrecorded_checkpoints(runtime, claim)

    settings = runtime.settings
    recorder = EventRecorder(runtime.sessionmaker, claim.job_id, flush_interval_s=settings.event_flush_interval_s,
                             max_batch=runtime.options.max_batch_events, publish=runtime.publish,
                             worker_id=runtime.worker_id, attempt=claim.attempt)
    outputs = job_outputs(runtime, claim, recorder, getattr(config, "kind", "train"))  # a remote worker's uploads
    done: list[dict[str, Any]] = []
    tracking = tracking_for(runtime, claim.job_id, claim.output_dir)  # a background thread: never waited on
    executor = executors.get(claim.executor)(runtime, claim)
    relay = relay_for(runtime, claim.job_id, getattr(config, "kind", "train"), executor)  # a chat session's requests

    def on_event(event: dict[str, Any]) -> None:
        if relay.take(event):
            return
        tracking.add(event)
        if event["type"] == "done":
            done.append(event)
        else:
            outputs.add(event)

    watchdog = Watchdog(runtime, claim, executor)
    relay.start()
    try:
        exit_, error = _drive(executor, watchdog, job_json, on_event, recorder, outputs)
    finally:
        relay.stop()
    if error is not None:
        tracking.finish(JobStatus.failed.value)
        return Outcome(JobStatus.failed, "worker_error", f"the worker failed while running the trainer: {error!r}"), None
    last_done = done[-1] if done else None
    outcome = classify(
        exit_, last_done, watchdog.stop_reason, cancel_grace_s=settings.cancel_grace_s,
        attempt=claim.attempt, max_attempts=settings.max_attempts,
    )
    outcome = outputs.finish(executor.settle(outcome, max_attempts=settings.max_attempts))
    tracking.finish(outcome.status.value if outcome.status else "lost")
    return outcome, last_done


def job_outputs(runtime: Runtime, claim: Claim, recorder: EventRecorder,
                kind: str) -> remote.LocalOutputs | remote.RemoteOutputs:
    """What a remote worker uploads of a job (worker/remote.py; a generation job's or eval run's
    lines: worker/remote_generation.py); a local worker's no-op twin."""
    if runtime.settings.remote_worker and kind in ("generate", "eval"):
        from worker.remote_generation import generation_outputs

        return generation_outputs(runtime, claim, recorder)
    return remote.job_outputs(runtime, claim, recorder)


def _drive(executor: Executor, watchdog: Watchdog, job_json: Path, on_event: OnEvent, recorder: EventRecorder,
           outputs: remote.LocalOutputs | remote.RemoteOutputs) -> tuple[TrainerExit, Exception | None]:
    """The executor's lifecycle: start, watch while flushing its events, collect (whatever
    happened); the exit and the worker's own failure meanwhile (None: none)."""
    error: Exception | None = None
    try:
        executor.start(job_json, on_event)
        watchdog.start()
        while executor.watch():
            recorder.wait(timeout=0.2)
            _flush(recorder, only_if_due=True)
            if recorder.lost:
                watchdog.lose("its events were refused: the job is another claim's now")
    except Exception as exc:  # noqa: BLE001 - our own failure still ends the trainer and the job
        log.exception("job %s: the worker failed while running the trainer", recorder.job_id)
        error = exc
    finally:
        watchdog.stop()
        exit_ = executor.collect()
        outputs.drain()
        _flush(recorder, only_if_due=False, attempts=5)
    return exit_, error


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
        set_worker_job(session, runtime.worker_id, runtime.other_job(job_id))
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
    if target is JobStatus.succeeded:
        start_job_evals(runtime, job_id)
    # Wake the host each startable job is placed on: a requeued job of several machines can be
    # claimed only by its leader's host, and a message to any host was dropped by the others
    # (then the job waited for the reaper's re-send, 2 minutes).
    woken = signal_waiting(runtime)
    if target is JobStatus.queued and job_id not in woken:
        runtime.enqueue(job_id)  # not placeable now (or the signal failed): any host, as before
    log.info("job %s → %s%s", job_id, target.value, f" ({outcome.error_code})" if outcome.error_code else "")
    return target.value


def start_job_evals(runtime: Runtime, job_id: str) -> None:
    """Queue the eval runs a succeeded training job names (``core.evals.after_training``); the
    wake-up after it sends them to a host. Best effort: a failure is logged, the job stays succeeded."""
    from core.evals.after_training import start_runs
    from core.jobs.submit import Origin, record

    def submit_run(session: Any, spec: Any, owner: Any, attach: Any) -> Any:
        return record(session, spec, owner, Origin(attach=attach), settings=runtime.settings, preflight=None)[0]

    try:
        started = start_runs(runtime.sessionmaker, job_id, settings=runtime.settings, record=submit_run)
    except Exception as exc:  # noqa: BLE001 - the training job's outcome is stored already
        log.warning("job %s: could not start its evals: %s", job_id, exc)
        return
    if started:
        log.info("job %s: eval runs queued as jobs %s", job_id, ", ".join(started))


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
