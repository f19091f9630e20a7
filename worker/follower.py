"""A follower machine's part of a multi-machine job (``jobs.run_node``, sent by the leader).

The task carries the job id, the attempt, the node rank and the rendezvous endpoint; the
``job_node`` row the leader wrote in its claim is the truth. The part starts once: a
conditional UPDATE sets ``started_at`` only while the job runs with that attempt and the row is
this host's and not started, so a redelivered message does nothing. The part runs torchrun with
this machine's reserved GPUs at the leader's ``Rendezvous``, through the multi-machine executor
(worker/executors/multi_machine.py); its stdout carries no events (global rank 0 is on the leader). It is killed (every process of the run) when the job no
longer runs with its attempt, the leader's worker stops heartbeating, or this worker shuts
down; then ``ended_at`` and the exit code are recorded, which the leader's ``PartsWatch``
(worker/nodes.py) reads. A part that cannot start records exit code -1, so the leader does not
wait for it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from sqlalchemy import func, select, update

from core.db import utcnow
from core.jobs.models import Job, JobNode
from core.jobs.states import JobStatus
from core.workers.models import GpuSlot, Worker
from worker.claim import Claim
from worker.executors import Signal
from worker.executors.multi_machine import MultiMachineExecutor
from worker.launch import Rendezvous
from worker.nodes import run_id
from worker.prepare import build_config, set_aside_unrecorded_checkpoints, with_shared_home
from worker.shared_storage import shared_home
from worker.runtime import Runtime

log = logging.getLogger(__name__)

NOT_STARTED = -1
"""``job_node.returncode`` of a part that could not start its ranks."""


def run_part(runtime: Runtime, job_id: str, attempt: int, node_rank: int, rdzv_endpoint: str) -> str:
    """Run node ``node_rank`` of ``job_id``'s attempt ``attempt`` on this host; returns
    ``skipped`` (not this host's, already started, or the job moved on), else the exit code."""
    runtime.ensure_registered()
    if not _start(runtime, job_id, attempt, node_rank):
        log.info("job %s attempt %d node %d: not startable here (started, ended or the job moved on)",
                 job_id, attempt, node_rank)
        return "skipped"
    runtime.started(job_id, 0)
    returncode = NOT_STARTED
    try:
        if runtime.shutdown_event.is_set():
            log.warning("job %s node %d: this worker is shutting down; the part does not start", job_id, node_rank)
        else:
            returncode = _run(runtime, job_id, attempt, node_rank, rdzv_endpoint)
    except Exception:  # noqa: BLE001 - the leader must learn that this part ended
        log.exception("job %s node %d: the worker failed to run its part", job_id, node_rank)
    finally:
        _end(runtime, job_id, attempt, node_rank, returncode)
        runtime.ended(job_id)
    log.info("job %s attempt %d node %d ended with exit code %d", job_id, attempt, node_rank, returncode)
    return str(returncode)


def _part(job_id: str, attempt: int, node_rank: int) -> Any:
    return (JobNode.job_id == job_id) & (JobNode.attempt == attempt) & (JobNode.node_rank == node_rank)


def _start(runtime: Runtime, job_id: str, attempt: int, node_rank: int) -> bool:
    running = select(Job.job_id).where(
        Job.job_id == job_id, Job.status == JobStatus.running.value, Job.attempts == attempt
    )
    with runtime.sessionmaker.begin() as session:
        return session.execute(
            update(JobNode)
            .where(_part(job_id, attempt, node_rank), JobNode.worker_id == runtime.worker_id,
                   JobNode.started_at.is_(None), JobNode.ended_at.is_(None), JobNode.job_id.in_(running))
            .values(started_at=utcnow())
            .execution_options(synchronize_session=False)
        ).rowcount == 1


def _end(runtime: Runtime, job_id: str, attempt: int, node_rank: int, returncode: int) -> None:
    with runtime.sessionmaker.begin() as session:
        session.execute(
            update(JobNode)
            .where(_part(job_id, attempt, node_rank), JobNode.ended_at.is_(None))
            .values(ended_at=utcnow(), returncode=returncode)
            .execution_options(synchronize_session=False)
        )


def _run(runtime: Runtime, job_id: str, attempt: int, node_rank: int, rdzv_endpoint: str) -> int:
    output_dir = runtime.settings.jobs_dir / job_id
    output_dir.mkdir(parents=True, exist_ok=True)
    with runtime.sessionmaker() as session:
        job = session.get(Job, job_id)
        part = session.get(JobNode, (job_id, attempt, node_rank))
        assert job is not None and part is not None, f"job {job_id} node {node_rank} vanished after it started"
        shared = shared_home(session, job_id, attempt)
        config = build_config(runtime, session, job, output_dir)
        slots = session.execute(
            select(GpuSlot.slot, GpuSlot.device).where(GpuSlot.worker_id == runtime.worker_id, GpuSlot.job_id == job_id)
            .order_by(GpuSlot.slot)
        ).all()
        leader = session.get(JobNode, (job_id, attempt, 0))
        # The attempt's machines, which a retry placed on fewer machines has less of than job.nodes.
        nnodes = session.scalar(select(func.count()).select_from(JobNode)
                                .where(JobNode.job_id == job_id, JobNode.attempt == attempt)) or job.nodes
        rendezvous = Rendezvous(nnodes, node_rank, rdzv_endpoint, run_id(job_id, attempt), part.address)
    if rdzv_endpoint != part.rdzv_endpoint:
        log.warning("job %s node %d: the message's endpoint %s is not the stored %s; using the stored one",
                    job_id, node_rank, rdzv_endpoint, part.rdzv_endpoint)
        rendezvous = Rendezvous(nnodes, node_rank, part.rdzv_endpoint, rendezvous.run_id, part.address)
    job_json = output_dir / f"job.node-{node_rank}.json"  # local mode shares the leader's directory
    claim = Claim(job_id=job_id, attempt=attempt, output_dir=output_dir, slots=tuple(row.slot for row in slots),
                  devices=tuple(row.device for row in slots), rendezvous=rendezvous, executor="multi_machine",
                  shared_home=shared)
    with_shared_home(config, claim).save(job_json)
    # Every rank resumes from its own disk (the same checkpoint as the leader), or from the shared
    # directory, which the leader prepares alone before its ranks start (the rendezvous waits for them).
    if runtime.settings.remote_worker and shared is None:
        _prepare_remote(runtime, claim)
    executor = MultiMachineExecutor(runtime, claim)
    try:
        executor.start(job_json, on_event=lambda event: None)  # global rank 0, the only one that emits, is on the leader
        _watch(runtime, executor, job_id, attempt, leader.worker_id if leader is not None else None)
    finally:
        exit_ = executor.collect()
    return exit_.returncode


def _prepare_remote(runtime: Runtime, claim: Claim) -> None:
    """As the leader does before its ranks start: set aside checkpoints newer than the store's
    newest, then fetch that one from the API if this machine lacks it (worker/remote.py)."""
    from worker import remote

    set_aside_unrecorded_checkpoints(runtime, claim)
    with remote.client_for(runtime.settings) as client:  # a failure ends this part: the leader retries the job
        remote.fetch_recorded_checkpoint(runtime, claim, client)


def _watch(runtime: Runtime, executor: MultiMachineExecutor, job_id: str, attempt: int, leader: str | None) -> None:
    """Until the part exits: kill it when it must stop (see the module docstring)."""
    poll_s = min(1.0, runtime.settings.heartbeat_interval_s)
    while executor.watch():
        why = _stop_reason(runtime, job_id, attempt, leader)
        if why is not None:
            log.warning("job %s: stopping this machine's ranks: %s", job_id, why)
            executor.signal(Signal.kill)
            return
        _sleep_until_exit(executor, poll_s)


def _sleep_until_exit(executor: MultiMachineExecutor, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and executor.watch():
        time.sleep(0.05)


def _stop_reason(runtime: Runtime, job_id: str, attempt: int, leader: str | None) -> str | None:
    if runtime.shutdown_event.is_set():
        return "this worker is shutting down"
    cutoff = utcnow() - dt.timedelta(seconds=runtime.settings.heartbeat_timeout_s)
    try:
        with runtime.sessionmaker() as session:
            job = session.execute(select(Job.status, Job.attempts).where(Job.job_id == job_id)).one_or_none()
            beat = session.execute(select(Worker.heartbeat_at).where(Worker.worker_id == leader)).scalar_one_or_none()
    except Exception as exc:  # noqa: BLE001 - a store hiccup is not a reason to kill the ranks
        log.warning("job %s: could not read the job's state: %s", job_id, exc)
        return None
    if job is None or job.status != JobStatus.running.value or job.attempts != attempt:
        return f"the job is {job.status if job else 'gone'} (attempt {job.attempts if job else '?'}), not attempt {attempt}"
    if beat is None or beat < cutoff:
        return f"the leader's worker {leader} stopped heartbeating"
    return None

