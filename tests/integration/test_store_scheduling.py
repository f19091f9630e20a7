"""Scheduling on the real stores (``core.jobs.scheduling``, ``core.jobs.eta``): claim order, the
per-user cap (also under concurrent claims), queue positions and start estimates. GPU pools,
all-or-none reservations, the head's hold and racing claims on one pool:
test_store_gpu_pools.py. The API's priority / gpus / queue fields: test_api_queue.py."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import select, update

from core.db import utcnow
from core.jobs import eta, scheduling
from core.jobs.models import Job, StepMetric
from core.jobs.placement import Placement
from core.workers.models import GpuSlot, Worker
from tests.fixtures.scheduling import add_job, add_user, claim_all, runtime_for, second_claim_waits_and_loses, status_of
from worker.runner import claim_next_job

pytestmark = pytest.mark.integration


class TestClaimOrder:
    def test_high_before_normal_before_low(self, store, sched_settings) -> None:
        settings = sched_settings.model_copy(update={"max_running_jobs_per_user": 0})
        low = add_job(store, priority="low", age_s=0)
        normal = add_job(store, priority="normal", age_s=1)
        high = add_job(store, priority="high", age_s=2)
        assert claim_all(store, settings) == [high, normal, low]

    def test_fifo_within_a_priority(self, store, sched_settings) -> None:
        settings = sched_settings.model_copy(update={"max_running_jobs_per_user": 0})
        jobs = [add_job(store, age_s=s) for s in (5, 1, 3)]
        assert claim_all(store, settings) == [jobs[1], jobs[2], jobs[0]]

    def test_the_claim_records_the_worker_and_attempt(self, store, sched_settings) -> None:
        job_id = add_job(store)
        claim = claim_next_job(runtime_for(store, sched_settings, "host/gpu0"), signalled="job-other")
        assert claim is not None and claim.job_id == job_id and claim.attempt == 1
        with store.sessions() as session:
            job = session.get(Job, job_id)
        assert (job.status, job.worker_id, job.started_at is not None) == ("running", "host/gpu0", True)

    def test_a_job_asking_more_gpus_than_a_worker_has_is_skipped(self, store, sched_settings) -> None:
        settings = sched_settings.model_copy(update={"max_running_jobs_per_user": 0})
        big = add_job(store, age_s=0, gpus=2)
        small = add_job(store, age_s=1)
        assert claim_all(store, settings, slots=1) == [small]
        assert status_of(store, big) == "queued"


class TestPerUserCap:
    def test_a_capped_users_job_waits_while_another_users_later_job_runs(self, store, sched_settings) -> None:
        alice, bob = add_user(store, "alice"), add_user(store, "bob")
        add_job(store, owner=alice, status="running", age_s=0)
        waiting = add_job(store, owner=alice, age_s=1, priority="high")
        later = add_job(store, owner=bob, age_s=2)
        assert claim_all(store, sched_settings) == [later]
        assert status_of(store, waiting) == "queued"

    def test_the_users_own_cap_overrides_the_setting(self, store, sched_settings) -> None:
        alice = add_user(store, "alice", max_running_jobs=2)
        add_job(store, owner=alice, status="running")
        second, third = add_job(store, owner=alice, age_s=1), add_job(store, owner=alice, age_s=2)
        assert claim_all(store, sched_settings) == [second]
        assert status_of(store, third) == "queued"

    def test_a_user_cap_of_zero_means_no_cap(self, store, sched_settings) -> None:
        alice = add_user(store, "alice", max_running_jobs=0)
        jobs = [add_job(store, owner=alice, age_s=s) for s in range(3)]
        assert claim_all(store, sched_settings) == jobs

    def test_the_global_setting_applies_without_an_override(self, store, sched_settings) -> None:
        alice = add_user(store, "alice")
        jobs = [add_job(store, owner=alice, age_s=s) for s in range(4)]
        settings = sched_settings.model_copy(update={"max_running_jobs_per_user": 3})
        assert claim_all(store, settings) == jobs[:3]

    def test_jobs_without_an_owner_share_one_cap(self, store, sched_settings) -> None:
        first, second = add_job(store, age_s=0), add_job(store, age_s=1)
        assert claim_all(store, sched_settings) == [first]
        assert status_of(store, second) == "queued"

    def test_a_finished_job_frees_the_slot_and_signals_the_waiting_job(self, store, sched_settings) -> None:
        alice = add_user(store, "alice")
        runtime_for(store, sched_settings, "w", slots=2).ensure_registered()
        running = add_job(store, owner=alice, status="running")
        waiting = add_job(store, owner=alice, age_s=1)
        with store.sessions() as session:
            assert scheduling.signal_targets(session, sched_settings) == []
        with store.sessions.begin() as session:
            session.execute(update(Job).where(Job.job_id == running).values(status="succeeded"))
        with store.sessions() as session:
            assert scheduling.signal_targets(session, sched_settings) == [Placement(waiting, "w", (0,))]


    def test_a_host_whose_slots_are_all_held_answers_without_replaying_the_queue(
            self, store, sched_settings, monkeypatch) -> None:
        runtime_for(store, sched_settings, "w", slots=1).ensure_registered()
        running = add_job(store, status="running")
        waiting = add_job(store, age_s=1)
        with store.sessions.begin() as session:
            session.execute(update(GpuSlot).where(GpuSlot.worker_id == "w").values(job_id=running))
        replays: list[str | None] = []
        real = scheduling.schedule
        monkeypatch.setattr(scheduling, "schedule", lambda *a, **k: replays.append(k.get("include")) or real(*a, **k))
        with store.sessions() as session:
            assert scheduling.next_placement(session, sched_settings, "w") is None
        assert replays == []  # a busy host gets a wake-up per submission: each must stay cheap
        with store.sessions.begin() as session:
            session.execute(update(GpuSlot).where(GpuSlot.worker_id == "w").values(job_id=None))
            session.execute(update(Job).where(Job.job_id == running).values(status="succeeded"))
        with store.sessions() as session:  # a free slot: the policy is asked, and places the waiting job
            assert scheduling.next_placement(session, sched_settings, "w") == Placement(waiting, "w", (0,))
        assert replays == ["w"]


class TestCapUnderConcurrentClaims:
    def test_a_second_claim_of_the_same_user_waits_for_the_first_and_then_loses(self, store, sched_settings) -> None:
        """Two workers each picked a different job of alice (cap 1) before either claimed."""
        alice = add_user(store, "alice")
        runtime_for(store, sched_settings, "w", slots=2).ensure_registered()
        first_job, second_job = add_job(store, owner=alice, age_s=0), add_job(store, owner=alice, age_s=1)
        second_claim_waits_and_loses(
            store, Placement(first_job, "w", (0,)), Placement(second_job, "w", (1,)), sched_settings
        )
        assert (status_of(store, first_job), status_of(store, second_job)) == ("running", "queued")

    def test_racing_workers_never_exceed_any_users_cap(self, store, sched_settings) -> None:
        alice, bob = add_user(store, "alice"), add_user(store, "bob", max_running_jobs=2)
        for i in range(4):
            add_job(store, owner=alice, age_s=i)
            add_job(store, owner=bob, age_s=i)
        workers = 6
        barrier = threading.Barrier(workers)
        claimed: list[str | None] = []
        lock = threading.Lock()

        def work(i: int) -> None:
            rt = runtime_for(store, sched_settings, f"w{i}")
            barrier.wait()
            claim = claim_next_job(rt)
            with lock:
                claimed.append(claim.job_id if claim else None)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        with store.sessions() as session:
            running = session.execute(select(Job.owner_id, Job.job_id).where(Job.status == "running")).all()
        per_owner = {owner: sum(1 for o, _ in running if o == owner) for owner in (alice, bob)}
        assert per_owner == {alice: 1, bob: 2}
        assert sorted(j for j in claimed if j) == sorted(j for _, j in running)
        assert claimed.count(None) == workers - 3


class TestQueueEstimates:
    def build(self, store) -> dict[str, str]:
        """Two live one-GPU hosts; w1 runs alice's job at 2 s/step with 60 of 100 steps left (120 s)."""
        alice, bob = add_user(store, "alice"), add_user(store, "bob")
        now = utcnow()
        with store.sessions.begin() as session:
            for name in ("w1", "w2"):
                session.add(Worker(worker_id=name, hostname="box", device="cpu", hardware={},
                                   started_at=now, heartbeat_at=now))
            session.add(Worker(worker_id="dead", hostname="box", device="cpu", hardware={},
                               started_at=now, heartbeat_at=now - dt.timedelta(hours=1)))
            session.flush()
            for name in ("w1", "w2", "dead"):
                session.add(GpuSlot(worker_id=name, slot=0))
        running = add_job(store, owner=alice, status="running", worker_id="w1", progress_step=40,
                          total_steps=100, started_at=now, model="m")
        with store.sessions.begin() as session:
            session.execute(update(GpuSlot).where(GpuSlot.worker_id == "w1").values(job_id=running, reserved_at=now))
            for step in range(21, 41):
                session.add(StepMetric(job_id=running, step=step, step_ms=1500.0,
                                       time=now - dt.timedelta(seconds=2 * (40 - step))))
        return {
            "running": running,
            "alice_high": add_job(store, owner=alice, priority="high", age_s=3, total_steps=10, model="m"),
            "bob_normal": add_job(store, owner=bob, age_s=1, total_steps=50, model="m"),
            "bob_low": add_job(store, owner=bob, priority="low", age_s=0, total_steps=5, model="m"),
            "unknown": add_job(store, owner=None, priority="low", age_s=9, total_steps=None, model="m"),
        }

    def test_positions_follow_claim_order_and_estimates_replay_caps(self, store, sched_settings) -> None:
        jobs = self.build(store)
        with store.sessions() as session:
            snap = eta.snapshot(session, sched_settings)
        at = {e.job.job_id: e.estimated_start_at for e in snap.entries}
        order = [e.job.job_id for e in snap.entries]
        assert order == [jobs["alice_high"], jobs["bob_normal"], jobs["bob_low"], jobs["unknown"]]
        assert [e.position for e in snap.entries] == [1, 2, 3, 4]
        assert snap.entry(jobs["bob_low"]).ahead == (jobs["alice_high"], jobs["bob_normal"])
        assert snap.live_workers == 2
        start = snap.computed_at

        def secs(job: str) -> float:
            return (at[job] - start).total_seconds()

        # w2 is idle: alice is at her cap (her running job ends at 120 s), so bob's normal job
        # starts now (50 steps x 2 s = 100 s); at 100 s bob's low job (bob is free again, alice
        # still capped) runs 10 s; at 110 s alice is still capped, so the anonymous job starts
        # (its length is unknown: w2 stays busy); at 120 s w1 is free and alice's job ends.
        assert secs(jobs["bob_normal"]) == pytest.approx(0, abs=1e-6)
        assert secs(jobs["bob_low"]) == pytest.approx(100)
        assert secs(jobs["alice_high"]) == pytest.approx(120)
        assert secs(jobs["unknown"]) == pytest.approx(110)
        (run,) = snap.running
        assert (run.job_id, run.worker_id) == (jobs["running"], "w1")
        assert (run.estimated_finish_at - start).total_seconds() == pytest.approx(120)

    def test_without_a_live_worker_every_estimate_is_unknown(self, store, sched_settings) -> None:
        jobs = self.build(store)
        with store.sessions.begin() as session:
            session.execute(update(Worker).values(heartbeat_at=utcnow() - dt.timedelta(hours=1)))
        with store.sessions() as session:
            snap = eta.snapshot(session, sched_settings)
        assert snap.live_workers == 0
        assert [e.estimated_start_at for e in snap.entries] == [None] * 4
        assert snap.entry(jobs["unknown"]).position == 4
