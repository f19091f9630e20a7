"""Jobs that span machines (``nodes > 1``): the leader's parts, the followers' runs, who stops whom.

    alone     a retry resumed on one machine (core/jobs/placement.py ``fewer``) runs as a job of one
              machine, but its claim writes that machine's ``job_node`` row too (``record_alone``),
              without a rendezvous, so the next retry is judged on it.
    claim     only the leader claims (core/jobs/placement.py: the part whose machine's address
              sorts first); its claim reserves every part's GPUs and, in the same transaction,
              writes one ``job_node`` row per machine with the rendezvous endpoint (its address
              and the first port from ``rdzv_port`` upward it can bind). After the commit it sends
              ``jobs.run_node`` to each follower's own queue.
    run       every machine runs torchrun with its share of the ranks (worker/launch.py
              ``Rendezvous``); they meet at the leader's c10d store. Events come from global rank
              0 only, which c10d puts on the leader (node ranks follow sorted ``--local-addr``).
    follower  re-reads its ``job_node`` row (a redelivered message finds it started, and stops),
              runs its part, and records when and how it ended (``ended_at``, ``returncode``).
    lost      the leader's ``PartsWatch`` kills its ranks when a follower's part ended with a
              signal or an error, or the follower's worker stopped heartbeating; the job then
              retries from its last checkpoint (``lost_part_outcome``) or fails. A follower's
              ``FollowerWatch`` kills its ranks when the job no longer runs with its attempt or
              the leader's worker stopped heartbeating. The reaper requeues a running job whose
              any machine is lost (``lost_parts``). Neither side waits for the trainer's
              collective timeout (``trainer.parallel.distributed.Comm``, 600 s): the watches act within
              ``heartbeat_timeout_s``, or at once when a part ends.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import threading
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs.models import Job, JobNode
from core.jobs.placement import Placement
from core.jobs.states import JobStatus
from core.settings import Settings
from core.workers.models import Worker
from worker.launch import Rendezvous
from worker.outcome import Outcome
from worker.process import TrainerProcess
from worker.runtime import Runtime

log = logging.getLogger(__name__)

PORTS_TRIED = 100
"""Ports from ``rdzv_port`` upward the leader tries before giving up."""
PART_START_TIMEOUT_S = 120.0
"""A follower whose part has not started this long after the claim (at least twice
``heartbeat_timeout_s``) is lost: its ``jobs.run_node`` message never reached a live worker."""
SETTLE_WAIT_SHARE = 0.5
"""A leader whose ranks failed waits at most this share of ``heartbeat_timeout_s`` to learn
whether a follower machine was lost (``PartsWatch.settle``)."""
SETTLE_SILENT_BEATS = 4
"""Heartbeats a follower's worker may miss before a leader whose ranks failed counts it lost."""


def free_port(address: str, first: int, tries: int = PORTS_TRIED, *, skip: frozenset[int] = frozenset()) -> int:
    """The first port from ``first`` upward, not in ``skip``, that can be bound on ``address`` now."""
    for port in range(first, min(first + tries, 65536)):
        if port in skip:
            continue
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port for the rendezvous on {address} in {first}..{first + tries - 1}; "
                       "set FTQ_RDZV_PORT to a free range")


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (a loopback address: the loopback
    interface, which answers all of 127/8); None when no interface has it."""
    import ipaddress

    import psutil

    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = False
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            ip = addr.address.split("%")[0]
            if ip == address or (loopback and addr.family in (socket.AF_INET, socket.AF_INET6)
                                 and ipaddress.ip_address(ip).is_loopback):
                return name
    return None


def pin_interface(env: dict[str, str], rendezvous: Rendezvous | None) -> dict[str, str]:
    """``env`` for a machine's ranks of a multi-machine job: gloo and NCCL talk on the interface
    of the machine's address (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``; values already set
    are kept). Without it gloo binds to what the host name resolves to, which is a loopback
    address on hosts whose /etc/hosts maps their name to 127.0.1.1 (Debian, Ubuntu), and the
    other machines cannot reach it."""
    if rendezvous is None:
        return env
    interface = interface_of(rendezvous.local_addr)
    if interface is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.setdefault(name, interface)
    return env


def endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def run_id(job_id: str, attempt: int) -> str:
    return f"{job_id}-{attempt}"


def record_parts(session: Session, settings: Settings, placement: Placement, attempt: int) -> Rendezvous | None:
    """In the claim's transaction: one ``job_node`` row per machine; the leader's rendezvous.

    None for a job on one machine (nothing is written).
    """
    if not placement.followers:
        return None
    leader = placement.address
    assert leader, f"job {placement.job_id}: a multi-machine placement without the leader's address"
    rdzv = endpoint(leader, free_port(leader, settings.rdzv_port, skip=_ports_in_use(session, leader)))
    now = utcnow()
    for rank, part in enumerate(placement.parts):
        session.add(JobNode(job_id=placement.job_id, attempt=attempt, node_rank=rank, worker_id=part.worker_id,
                            address=part.address or "", rdzv_endpoint=rdzv, started_at=now if rank == 0 else None))
    session.flush()
    return Rendezvous(len(placement.parts), 0, rdzv, run_id(placement.job_id, attempt), leader)


def record_alone(session: Session, placement: Placement, attempt: int) -> None:
    """In the claim's transaction: the one ``job_node`` row of an attempt of a multi-machine job
    resumed on one machine (core/jobs/placement.py ``fewer``), like every attempt's, so a later
    retry is judged on the machine this one ran on (core/jobs/fewer_machines.py); no rendezvous."""
    address = session.scalar(select(Worker.address).where(Worker.worker_id == placement.worker_id))
    session.add(JobNode(job_id=placement.job_id, attempt=attempt, node_rank=0, worker_id=placement.worker_id,
                        address=address or "", rdzv_endpoint="", started_at=utcnow()))
    session.flush()


def _ports_in_use(session: Session, address: str) -> frozenset[int]:
    """Rendezvous ports of running jobs led from ``address``: one claimed a moment ago may not
    have bound its port yet."""
    rows = session.scalars(
        select(JobNode.rdzv_endpoint)
        .join(Job, (Job.job_id == JobNode.job_id) & (Job.attempts == JobNode.attempt))
        .where(JobNode.node_rank == 0, JobNode.address == address, Job.status == JobStatus.running.value,
               JobNode.rdzv_endpoint != "")  # an attempt on one machine (``record_alone``) has no rendezvous
    )
    return frozenset(int(row.rsplit(":", 1)[1]) for row in rows)


def send_followers(runtime: Runtime, job_id: str, attempt: int) -> int:
    """After the claim's commit: ``jobs.run_node`` to each follower's host; returns how many."""
    with runtime.sessionmaker() as session:
        parts = session.scalars(
            select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.node_rank > 0)
        ).all()
    if runtime.celery is None:
        log.warning("job %s: no broker to start its %d follower machine(s)", job_id, len(parts))
        return 0
    from core.queue import enqueue_node

    sent = 0
    for part in parts:
        try:
            enqueue_node(runtime.celery, job_id, attempt, part.node_rank, part.rdzv_endpoint, part.worker_id)
            sent += 1
        except Exception as exc:  # noqa: BLE001 - the broker is down: the part never starts, the leader's
            # watch counts it lost after its start timeout and the job is retried; the leader still runs
            log.warning("job %s: could not send node %d its start message (broker: %s)", job_id, part.node_rank, exc)
    return sent


def parts_of(session: Session, job_id: str, attempt: int) -> list[JobNode]:
    return list(session.scalars(
        select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt).order_by(JobNode.node_rank)
    ))


def lost_parts(settings: Settings, now: dt.datetime | None = None) -> Any:
    """Subquery: running multi-machine jobs a machine of whose current attempt is lost (its
    part not ended and its worker silent for ``heartbeat_timeout_s``), for the reaper."""
    cutoff = (now or utcnow()) - dt.timedelta(seconds=settings.heartbeat_timeout_s)
    return (
        select(JobNode.job_id)
        .join(Job, (Job.job_id == JobNode.job_id) & (Job.attempts == JobNode.attempt))
        .join(Worker, Worker.worker_id == JobNode.worker_id, isouter=True)
        .where(Job.status == JobStatus.running.value, Job.nodes > 1, JobNode.ended_at.is_(None),
               (Worker.heartbeat_at.is_(None)) | (Worker.heartbeat_at < cutoff))
    )


def _silent(session: Session, worker_id: str, cutoff: dt.datetime) -> bool:
    beat = session.execute(select(Worker.heartbeat_at).where(Worker.worker_id == worker_id)).scalar_one_or_none()
    return beat is None or beat < cutoff


def lost_follower(session: Session, job_id: str, attempt: int, settings: Settings, *, any_error: bool = True,
                  silent_s: float | None = None) -> str | None:
    """Why a follower machine of this attempt is lost (None: every part runs or ended well).

    A part that ended by a signal, or not ended while its worker has been silent for
    ``silent_s`` (default ``heartbeat_timeout_s``), is lost; one that ended with an error code
    too when ``any_error`` (while the leader still runs: after the leader's own ranks failed,
    the followers' end with an error because of it).
    """
    silent_s = settings.heartbeat_timeout_s if silent_s is None else silent_s
    now = utcnow()
    cutoff = now - dt.timedelta(seconds=silent_s)
    parts = parts_of(session, job_id, attempt)
    start_by = now - dt.timedelta(seconds=max(PART_START_TIMEOUT_S, 2 * settings.heartbeat_timeout_s))
    for part in parts[1:]:
        code = part.returncode
        if part.started_at is None and parts[0].started_at is not None and parts[0].started_at < start_by:
            return f"node {part.node_rank} ({part.worker_id}) never started its part (its message was lost?)"
        if part.ended_at is not None and code is not None and (code < 0 or (any_error and code > 0)):
            return f"node {part.node_rank} ({part.worker_id}) ended with exit code {code}"
        if part.ended_at is None and _silent(session, part.worker_id, cutoff):
            return f"node {part.node_rank} ({part.worker_id}) stopped heartbeating (silent over {silent_s:g}s)"
    return None


class PartsWatch:
    """On the leader: kills its ranks once a follower machine is lost (``lost_follower``), and
    turns the run's outcome into a retry (``settle``)."""

    def __init__(self, runtime: Runtime, job_id: str, attempt: int, trainer: TrainerProcess) -> None:
        self._runtime = runtime
        self._job_id = job_id
        self._attempt = attempt
        self._trainer = trainer
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"parts-{job_id}", daemon=True)
        self.lost: str | None = None
        """Why the ranks were stopped (a follower machine was lost); None: they were not."""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _lost(self, *, any_error: bool, silent_s: float | None = None) -> str | None:
        try:
            with self._runtime.sessionmaker() as session:
                return lost_follower(session, self._job_id, self._attempt, self._runtime.settings,
                                     any_error=any_error, silent_s=silent_s)
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the runner's watchdog handles a long one
            log.warning("job %s: could not read its machines: %s", self._job_id, exc)
            return None

    def _loop(self) -> None:
        poll_s = min(1.0, self._runtime.settings.heartbeat_interval_s)
        while not self._stopped.wait(poll_s):
            why = self._lost(any_error=True)
            if why is not None and not self._trainer.has_exited():
                log.warning("job %s: stopping every rank of this machine: %s", self._job_id, why)
                self.lost = why
                self._trainer.kill()
                return

    def _wait_for_parts(self) -> str | None:
        """After the leader's ranks failed: whether a follower machine was lost. A lost
        follower's ranks make rank 0 fail with a connection error, often before its worker
        writes the part's end, or before a dead worker's silence reaches the heartbeat timeout:
        so this waits until every part ended, one ended by a signal, or a follower's worker
        missed ``SETTLE_SILENT_BEATS`` heartbeats (a false alarm only turns a failure into a
        retry), for at most ``SETTLE_WAIT_SHARE`` of the heartbeat timeout (the job's own
        heartbeat is not beaten meanwhile; the reaper must not take it first)."""
        settings = self._runtime.settings
        silent_s = SETTLE_SILENT_BEATS * settings.heartbeat_interval_s
        deadline = time.monotonic() + SETTLE_WAIT_SHARE * settings.heartbeat_timeout_s
        while True:
            why = self._lost(any_error=False, silent_s=silent_s)
            if why is not None or time.monotonic() >= deadline or self._all_ended():
                return why
            time.sleep(0.2)

    def _all_ended(self) -> bool:
        try:
            with self._runtime.sessionmaker() as session:
                return all(p.ended_at is not None for p in parts_of(session, self._job_id, self._attempt)[1:])
        except Exception:  # noqa: BLE001 - unknown: keep waiting until the deadline
            return False

    def settle(self, outcome: Outcome, *, max_attempts: int) -> Outcome:
        """The run's outcome, or, when a follower machine was lost, a retry from the last
        checkpoint (counting an attempt) while attempts remain, else failed ``node_lost``.
        A success, a cancel, a shutdown's hand-back and a job no longer ours are kept."""
        if outcome.status in (None, JobStatus.succeeded, JobStatus.cancelled):
            return outcome
        if outcome.status is JobStatus.queued and not outcome.retry:
            return outcome
        why = self.lost or self._wait_for_parts()
        if why is None:
            return outcome
        if self._attempt < max_attempts:
            return Outcome(JobStatus.queued, "node_lost", f"retrying from the last checkpoint: {why}", retry=True)
        return Outcome(JobStatus.failed, "node_lost",
                       f"{why}; gave up after {self._attempt} attempts (max_attempts={max_attempts})")
