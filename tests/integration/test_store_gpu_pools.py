"""Multi-GPU scheduling on the real stores (PostgreSQL and SQLite): each worker host's GPU pool,
all-or-none reservations on one host, release when a job stops running, the head of the queue's
hold against a stream of 1-GPU jobs, the cap on GPUs, the check at submission, and claims racing
on one pool (threads on one host, and two claimants of overlapping GPUs)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select, update

from core.db import utcnow
from core.errors import Unsupported
from core.jobs import scheduling, service
from core.jobs.models import Job
from core.jobs.placement import Placement
from core.jobs.states import JobStatus
from core.workers.models import GpuSlot, Worker
from tests.fixtures.scheduling import add_job, add_user, runtime_for, second_claim_waits_and_loses, status_of
from worker.runner import claim_next_job

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(store, tmp_path):
    from core.settings import Settings

    return Settings(data_dir=tmp_path / "data", database_url=store.url, max_running_jobs_per_user=0).resolved()


def host(store, settings, name: str, slots: int):
    rt = runtime_for(store, settings, name, slots)
    rt.ensure_registered()
    return rt


def held(store) -> dict[str, list[tuple[str, int]]]:
    """job id → the (host, slot) pairs it holds."""
    out: dict[str, list[tuple[str, int]]] = {}
    with store.sessions() as session:
        for row in session.scalars(select(GpuSlot).where(GpuSlot.job_id.is_not(None)).order_by(GpuSlot.slot)):
            out.setdefault(row.job_id, []).append((row.worker_id, row.slot))
    return out


def occupy(store, settings, name: str, slots: tuple[int, ...], owner: str) -> str:
    """A running job of ``owner`` on ``slots`` of host ``name``, claimed where the test says."""
    job = add_job(store, owner=add_user(store, owner), gpus=len(slots))
    with store.sessions() as session:
        assert scheduling.try_claim(session, Placement(job, name, slots), settings)
        session.commit()
    return job


def finish(store, job_id: str) -> None:
    with store.sessions.begin() as session:
        assert service.transition(session, job_id, JobStatus.succeeded)


class TestReservation:
    def test_a_claim_reserves_n_gpus_of_its_host_with_the_job(self, store, settings) -> None:
        rt = host(store, settings, "box", 4)
        job = add_job(store, gpus=2)
        claim = claim_next_job(rt)
        assert claim is not None and (claim.job_id, claim.slots) == (job, (0, 1))
        assert status_of(store, job) == "running" and held(store) == {job: [("box", 0), ("box", 1)]}

    def test_a_job_leaving_running_frees_its_gpus(self, store, settings) -> None:
        rt = host(store, settings, "box", 4)
        job = add_job(store, gpus=3)
        claim_next_job(rt)
        finish(store, job)
        assert held(store) == {}

    def test_free_gpus_on_two_hosts_do_not_make_one_job(self, store, settings) -> None:
        a, b = host(store, settings, "a", 2), host(store, settings, "b", 2)
        occupy(store, settings, "a", (0,), "ua")
        occupy(store, settings, "b", (0,), "ub")
        big = add_job(store, gpus=2, age_s=5)
        assert claim_next_job(a) is None and claim_next_job(b) is None
        assert status_of(store, big) == "queued"

    def test_a_job_fitting_no_live_host_is_passed_over(self, store, settings) -> None:
        rt = host(store, settings, "box", 2)
        add_job(store, gpus=4, age_s=0)
        small = add_job(store, owner=add_user(store, "bob"), age_s=1)
        assert claim_next_job(rt).job_id == small

    def test_a_dead_hosts_gpus_are_not_offered(self, store, settings) -> None:
        host(store, settings, "dead", 4)
        with store.sessions.begin() as session:
            session.execute(update(Worker).values(heartbeat_at=utcnow().replace(year=2020)))
        add_job(store, gpus=2)
        with store.sessions() as session:
            assert scheduling.signal_targets(session, settings) == []


class TestHeadHold:
    def test_the_head_holds_its_host_against_later_one_gpu_jobs(self, store, settings) -> None:
        rt = host(store, settings, "box", 4)
        running = [add_job(store, owner=add_user(store, f"r{i}"), age_s=i) for i in range(2)]
        assert [claim_next_job(rt).job_id for _ in running] == running
        head = add_job(store, owner=add_user(store, "alice"), gpus=4, age_s=10)
        small = add_job(store, owner=add_user(store, "bob"), age_s=11)
        assert claim_next_job(rt) is None  # two GPUs are free, but they are held for the head
        with store.sessions() as session:
            hold = scheduling.schedule(session, settings).hold
        assert hold is not None and (hold.job_id, hold.worker_id, hold.free) == (head, "box", 2)
        assert status_of(store, small) == "queued"

    def test_later_jobs_backfill_onto_another_host(self, store, settings) -> None:
        box, other = host(store, settings, "box", 4), host(store, settings, "other", 1)
        occupy(store, settings, "box", (0,), "r")
        add_job(store, owner=add_user(store, "alice"), gpus=4, age_s=10)
        small = add_job(store, owner=add_user(store, "bob"), age_s=11)
        assert claim_next_job(box) is None
        assert claim_next_job(other).job_id == small

    def test_a_stream_of_one_gpu_jobs_does_not_starve_a_four_gpu_job(self, store, settings) -> None:
        """Each round one running job ends and a new 1-GPU job (another user's) arrives; the
        4-GPU job submitted earlier starts once the four jobs running when it came have ended."""
        rt = host(store, settings, "box", 4)
        running = [add_job(store, owner=add_user(store, f"r{i}"), age_s=i) for i in range(4)]
        for _ in running:
            claim_next_job(rt)
        big = add_job(store, owner=add_user(store, "alice"), gpus=4, age_s=10)
        for round_ in range(6):
            add_job(store, owner=add_user(store, f"s{round_}"), age_s=20 + round_)
            if running:
                finish(store, running.pop(0))
            claim = claim_next_job(rt)
            if claim is not None and claim.job_id == big:
                break
            assert claim is None, f"round {round_}: a 1-GPU job took a GPU held for the 4-GPU job"
        assert round_ == 3 and status_of(store, big) == "running"
        assert held(store) == {big: [("box", s) for s in range(4)]}


class TestCapCountsGpus:
    def test_a_users_running_gpus_plus_the_jobs_must_fit_their_cap(self, store, settings) -> None:
        rt = host(store, settings, "box", 8)
        alice = add_user(store, "alice", max_running_jobs=3)
        first = add_job(store, owner=alice, gpus=2, age_s=0)
        second = add_job(store, owner=alice, gpus=2, age_s=1)
        assert claim_next_job(rt).job_id == first
        assert claim_next_job(rt) is None and status_of(store, second) == "queued"
        finish(store, first)
        assert claim_next_job(rt).job_id == second

    def test_submission_refuses_more_gpus_than_the_largest_live_host(self, store, settings) -> None:
        host(store, settings, "box-a", 2)
        host(store, settings, "box-b", 4)
        with store.sessions() as session:
            scheduling.check_gpus(session, 4, settings)
            with pytest.raises(Unsupported) as error:
                scheduling.check_gpus(session, 5, settings)
        assert error.value.param == "gpus"
        assert "box-a (2 GPUs), box-b (4 GPUs)" in error.value.message and "at most 4" in error.value.message

    def test_submission_refuses_more_gpus_than_the_owners_cap(self, store, settings) -> None:
        host(store, settings, "box", 8)
        alice = add_user(store, "alice", max_running_jobs=2)
        with store.sessions() as session, pytest.raises(Unsupported, match="cap of 2 running GPUs"):
            scheduling.check_gpus(session, 3, settings, owner_id=alice)

    def test_without_a_live_host_any_count_is_accepted_and_waits(self, store, settings) -> None:
        with store.sessions() as session:
            scheduling.check_gpus(session, 8, settings)


class TestRacingClaims:
    def test_threads_of_one_host_never_share_a_gpu_or_split_a_job(self, store, settings) -> None:
        """Eight task threads of one 6-GPU host claim at once from a queue of 2-, 3- and 1-GPU
        jobs: every running job holds exactly its GPUs, all on the host, none twice."""
        sizes = [2, 3, 2, 1, 1, 2, 1, 3]
        jobs = {add_job(store, owner=add_user(store, f"u{i}"), gpus=n, age_s=i): n for i, n in enumerate(sizes)}
        host(store, settings, "box", 6)
        barrier = threading.Barrier(8)
        claimed: list[str] = []
        lock = threading.Lock()

        def work() -> None:
            rt = runtime_for(store, settings, "box", 6)
            barrier.wait()
            while (claim := claim_next_job(rt)) is not None:
                with lock:
                    claimed.append(claim.job_id)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        with store.sessions() as session:
            running = set(session.scalars(select(Job.job_id).where(Job.status == "running")))
        holdings = held(store)
        assert sorted(claimed) == sorted(running) == sorted(holdings)
        assert all(len(holdings[j]) == jobs[j] for j in running)
        slots = [slot for pairs in holdings.values() for slot in pairs]
        assert len(slots) == len(set(slots)) and sum(jobs[j] for j in running) <= 6
        # in claim order: 2 GPUs (0-1), 3 GPUs (2-4); the next 2-GPU job is the head and holds
        # the last free GPU, so the 1-GPU jobs behind it do not take it
        assert sorted(jobs[j] for j in running) == [2, 3]

    def test_a_claim_of_overlapping_gpus_waits_for_the_first_and_then_loses(self, store, settings) -> None:
        host(store, settings, "box", 4)
        first_job = add_job(store, owner=add_user(store, "alice"), gpus=2, age_s=0)
        second_job = add_job(store, owner=add_user(store, "bob"), gpus=2, age_s=1)
        second_claim_waits_and_loses(
            store, Placement(first_job, "box", (0, 1)), Placement(second_job, "box", (1, 2)), settings
        )
        assert status_of(store, second_job) == "queued" and held(store) == {first_job: [("box", 0), ("box", 1)]}

    def test_a_lost_half_reservation_is_rolled_back_with_the_claim(self, store, settings) -> None:
        host(store, settings, "box", 3)
        taken = add_job(store, owner=add_user(store, "alice"), age_s=0)
        wanted = add_job(store, owner=add_user(store, "bob"), gpus=2, age_s=1)
        with store.sessions() as session:
            assert scheduling.try_claim(session, Placement(taken, "box", (1,)), settings)
            session.commit()
        with store.sessions() as session:
            assert not scheduling.try_claim(session, Placement(wanted, "box", (0, 1)), settings)
            session.rollback()
        assert held(store) == {taken: [("box", 1)]} and status_of(store, wanted) == "queued"
