"""Multi-machine jobs on the worker side, over a SQLite store: the leader's claim (every part's
GPUs, the ``job_node`` rows, one ``jobs.run_node`` per follower), torchrun's arguments, a
follower's single start, how a lost follower turns the leader's outcome into a retry, and the
reaper requeueing a job whose follower machine went silent."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from core.db import utcnow
from core.jobs.models import Job, JobNode
from core.jobs.states import JobStatus
from core.queue import TASK_RUN_NODE, host_queue
from core.settings import Settings
from core.workers.models import GpuSlot, Worker
from core.workers.pool import register_pool
from tests.fixtures.worker_runtime import queued_job, recording_runtime
from worker import follower, nodes
from worker.launch import Rendezvous, torchrun_argv
from worker.outcome import Outcome
from worker.reaper import reap
from worker.runner import claim_next_job
from worker.runtime import Runtime, WorkerOptions

LEADER, FOLLOWER = "box-a/gpu0", "box-b/gpu0"


class SentTasks:
    def __init__(self) -> None:
        self.sent: list[tuple[str, list[Any], str]] = []

    def send_task(self, name: str, *, args: list[Any], queue: str) -> None:
        self.sent.append((name, args, queue))


@pytest.fixture
def leader(settings: Settings) -> Iterator[Runtime]:
    settings = settings.model_copy(update={"max_running_jobs_per_user": 0, "worker_address": "127.0.0.1",
                                           "rdzv_port": 29700})
    rt = recording_runtime(settings, ("0",), LEADER)
    rt.celery = SentTasks()  # type: ignore[assignment]
    rt.ensure_registered()
    with rt.sessionmaker.begin() as session:
        now = utcnow()
        session.add(Worker(worker_id=FOLLOWER, hostname="b", device="cuda:0", hardware={}, started_at=now,
                           heartbeat_at=now, address="127.0.0.2"))
        session.flush()
        register_pool(session, FOLLOWER, ("0",))
    yield rt
    rt.engine.dispose()


class TestLeaderClaim:
    def test_the_leader_reserves_every_part_records_the_machines_and_starts_the_follower(self, leader):
        job_id = queued_job(leader)
        claim = claim_next_job(leader)
        assert claim is not None and claim.job_id == job_id and claim.slots == (0,)
        assert claim.rendezvous == Rendezvous(2, 0, "127.0.0.1:29700", f"{job_id}-1", "127.0.0.1")
        with leader.sessionmaker() as session:
            held = session.execute(select(GpuSlot.worker_id).where(GpuSlot.job_id == job_id)).scalars().all()
            parts = nodes.parts_of(session, job_id, 1)
        assert sorted(held) == [LEADER, FOLLOWER]
        assert [(p.node_rank, p.worker_id, p.address) for p in parts] == [(0, LEADER, "127.0.0.1"), (1, FOLLOWER, "127.0.0.2")]
        assert parts[0].started_at is not None and parts[1].started_at is None
        assert leader.celery.sent == [(TASK_RUN_NODE, [job_id, 1, 1, "127.0.0.1:29700"], host_queue(FOLLOWER))]

    def test_a_second_job_led_from_the_same_machine_gets_another_rendezvous_port(self, leader):
        first = queued_job(leader)
        assert claim_next_job(leader).rendezvous.endpoint == "127.0.0.1:29700"
        with leader.sessionmaker.begin() as session:  # free the GPUs, the first job still running
            session.execute(update(GpuSlot).where(GpuSlot.job_id == first).values(job_id=None))
        queued_job(leader)
        assert claim_next_job(leader).rendezvous.endpoint == "127.0.0.1:29701"

    def test_the_follower_host_does_not_claim_it(self, leader):
        queued_job(leader)
        other = Runtime(leader.settings, WorkerOptions(gpus=("0",), name=FOLLOWER), engine=leader.engine,
                        sessionmaker=leader.sessionmaker)
        other.ensure_registered()
        assert claim_next_job(other) is None

    def test_it_waits_while_the_follower_machine_has_no_free_gpu(self, leader):
        busy = queued_job(leader, gpus=1, nodes=1, status="running")
        with leader.sessionmaker.begin() as session:
            session.execute(update(GpuSlot).where(GpuSlot.worker_id == FOLLOWER).values(job_id=busy))
        queued_job(leader)
        assert claim_next_job(leader) is None


class TestLaunch:
    def test_every_machine_runs_torchrun_at_the_leaders_rendezvous(self, leader):
        rdzv = Rendezvous(2, 1, "127.0.0.2:29400", "job-1", "127.0.0.3")
        argv = torchrun_argv(leader.options, Path("job.json"), ranks=1, rank_log_dir=Path("logs"), rendezvous=rdzv)
        for flag in ("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.2:29400",
                     "--rdzv-id=job-1", "--rdzv-conf=is_host=0", "--local-addr=127.0.0.3", "--nproc-per-node=1"):
            assert flag in argv
        assert "--standalone" not in argv
        leader_argv = torchrun_argv(leader.options, Path("job.json"), ranks=2, rank_log_dir=Path("logs"),
                                  rendezvous=Rendezvous(2, 0, "127.0.0.2:29400", "job-1", "127.0.0.2"))
        assert "--rdzv-conf=is_host=1" in leader_argv

    def test_the_rendezvous_port_skips_a_taken_one(self):
        import socket

        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            port = taken.getsockname()[1]
            taken.listen()
            assert nodes.free_port("127.0.0.1", port) > port


class TestFollower:
    def test_a_part_starts_once_only_on_its_host_and_only_for_the_running_attempt(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        other = Runtime(leader.settings, WorkerOptions(gpus=("0",), name=FOLLOWER), engine=leader.engine,
                        sessionmaker=leader.sessionmaker)
        assert not follower._start(leader, job_id, 1, 1), "not the leader's part"
        assert not follower._start(other, job_id, 2, 1), "not the running attempt"
        assert follower._start(other, job_id, 1, 1)
        assert not follower._start(other, job_id, 1, 1), "a redelivered message starts nothing"


def _end_part(rt: Runtime, job_id: str, returncode: int | None, *, ended: bool = True) -> None:
    with rt.sessionmaker.begin() as session:
        session.execute(update(JobNode).where(JobNode.job_id == job_id, JobNode.node_rank == 1)
                        .values(ended_at=utcnow() if ended else None, returncode=returncode))


class TestLostFollower:
    def _watch(self, rt: Runtime, job_id: str) -> nodes.PartsWatch:
        return nodes.PartsWatch(rt, job_id, 1, trainer=None)  # type: ignore[arg-type]

    def test_a_follower_killed_by_a_signal_makes_a_failed_run_a_retry(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        _end_part(leader, job_id, -9)
        crashed = Outcome(JobStatus.failed, "trainer_crashed", "rank 0: connection reset by peer")
        settled = self._watch(leader, job_id).settle(crashed, max_attempts=2)
        assert settled.status is JobStatus.queued and settled.retry and settled.error_code == "node_lost"
        assert "node 1" in (settled.message or "")
        assert self._watch(leader, job_id).settle(crashed, max_attempts=1).status is JobStatus.failed

    def test_success_and_cancel_are_kept_and_an_error_caused_by_the_leader_is_not_a_loss(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        _end_part(leader, job_id, -9)
        ok = Outcome(JobStatus.succeeded)
        assert self._watch(leader, job_id).settle(ok, max_attempts=2) is ok
        _end_part(leader, job_id, 1)
        crashed = Outcome(JobStatus.failed, "invalid_data", "bad record")
        assert self._watch(leader, job_id).settle(crashed, max_attempts=2) is crashed

    def test_after_the_leaders_ranks_failed_a_follower_worker_missing_beats_counts_as_lost(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        with leader.sessionmaker.begin() as session:  # 5 heartbeat intervals: under the timeout, over 4 beats
            session.execute(update(Worker).where(Worker.worker_id == FOLLOWER)
                            .values(heartbeat_at=utcnow() - dt.timedelta(seconds=5 * leader.settings.heartbeat_interval_s)))
            assert nodes.lost_follower(session, job_id, 1, leader.settings) is None
        crashed = Outcome(JobStatus.failed, "trainer_crashed", "rank 0: connection closed by peer")
        settled = self._watch(leader, job_id).settle(crashed, max_attempts=2)
        assert settled.error_code == "node_lost" and "stopped heartbeating" in (settled.message or "")

    def test_a_follower_that_never_starts_its_part_is_lost(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        with leader.sessionmaker.begin() as session:
            assert nodes.lost_follower(session, job_id, 1, leader.settings) is None
            session.execute(update(JobNode).where(JobNode.job_id == job_id, JobNode.node_rank == 0)
                            .values(started_at=utcnow() - dt.timedelta(seconds=nodes.PART_START_TIMEOUT_S + 1)))
            why = nodes.lost_follower(session, job_id, 1, leader.settings)
        assert why is not None and "never started" in why

    def test_a_silent_follower_worker_is_lost(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        with leader.sessionmaker.begin() as session:
            session.execute(update(Worker).where(Worker.worker_id == FOLLOWER)
                            .values(heartbeat_at=utcnow() - dt.timedelta(seconds=600)))
            why = nodes.lost_follower(session, job_id, 1, leader.settings)
        assert why is not None and "stopped heartbeating" in why

    def test_the_reaper_requeues_a_job_whose_follower_machine_is_lost(self, leader):
        job_id = queued_job(leader)
        claim_next_job(leader)
        assert reap(leader.sessionmaker, leader.settings, enqueue=leader.enqueue).requeued == []
        with leader.sessionmaker.begin() as session:
            session.execute(update(Worker).where(Worker.worker_id == FOLLOWER)
                            .values(heartbeat_at=utcnow() - dt.timedelta(seconds=600)))
        report = reap(leader.sessionmaker, leader.settings, enqueue=leader.enqueue)
        assert report.requeued == [job_id]
        with leader.sessionmaker() as session:
            assert session.get(Job, job_id).status == JobStatus.queued.value
            assert session.scalars(select(GpuSlot.job_id).where(GpuSlot.job_id == job_id)).all() == []


class TestSubmissionCheck:
    def test_m_machines_with_their_share_each_are_accepted_and_more_are_refused_naming_nodes(self, leader):
        from core.errors import Unsupported
        from core.jobs.scheduling import check_gpus

        with leader.sessionmaker() as session:
            check_gpus(session, 2, leader.settings, nodes=2)
            for gpus, nodes_ in ((4, 2), (3, 3)):
                with pytest.raises(Unsupported) as refused:
                    check_gpus(session, gpus, leader.settings, nodes=nodes_)
                assert refused.value.param == "nodes" and "FTQ_WORKER_ADDRESS" in str(refused.value)
            with pytest.raises(Unsupported):
                check_gpus(session, 2, leader.settings)  # one machine: 1 GPU each


class TestInterface:
    def test_ranks_talk_on_the_interface_of_the_machines_address(self):
        rdzv = Rendezvous(2, 1, "127.0.0.2:29400", "job-1", "127.0.0.3")
        env = nodes.pin_interface({}, rdzv)
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == nodes.interface_of("127.0.0.1")
        assert env["GLOO_SOCKET_IFNAME"] is not None

    def test_a_set_interface_and_one_machine_jobs_are_left_alone(self):
        rdzv = Rendezvous(2, 1, "127.0.0.2:29400", "job-1", "127.0.0.3")
        assert nodes.pin_interface({"GLOO_SOCKET_IFNAME": "eth9"}, rdzv)["GLOO_SOCKET_IFNAME"] == "eth9"
        assert nodes.pin_interface({}, None) == {}
        assert nodes.interface_of("198.51.100.77") is None, "no interface holds a TEST-NET-2 address"
