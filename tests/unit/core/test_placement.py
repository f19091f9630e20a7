"""The queue policy (``core.jobs.placement.place``) on hand-built hosts: GPU counts on one host,
best fit, the head's hold and backfill, the cap on GPUs, and no starvation over time."""

from __future__ import annotations

import datetime as dt

from core.jobs.placement import Hold, Host, Placement, Waiting, place

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def job(job_id: str, gpus: int = 1, owner: str | None = None) -> Waiting:
    return Waiting(job_id, owner, "normal", gpus, "m", 10, T0)


def host(name: str, size: int, busy: tuple[int, ...] = ()) -> Host:
    slots = tuple(range(size))
    return Host(name, slots, tuple(s for s in slots if s not in busy))


class TestFit:
    def test_a_job_takes_n_gpus_of_one_host(self):
        schedule = place([job("a", 2)], [host("h", 4)], {}, {})
        assert schedule.placements == (Placement("a", "h", (0, 1)),) and schedule.hold is None

    def test_free_gpus_split_over_two_hosts_do_not_make_a_job(self):
        schedule = place([job("a", 2, "x")], [host("h1", 2, busy=(0,)), host("h2", 2, busy=(1,))], {}, {})
        assert schedule.placements == ()

    def test_best_fit_leaves_the_big_hole_for_a_big_job(self):
        hosts = [host("big", 4), host("small", 2, busy=(0,))]
        schedule = place([job("one", 1, "x"), job("four", 4, "y")], hosts, {}, {})
        assert schedule.placements == (Placement("one", "small", (1,)), Placement("four", "big", (0, 1, 2, 3)))

    def test_the_lowest_free_slots_are_taken(self):
        schedule = place([job("a", 2)], [host("h", 4, busy=(0, 2))], {}, {})
        assert schedule.placements == (Placement("a", "h", (1, 3)),)

    def test_a_job_bigger_than_every_host_is_passed_over_and_holds_nothing(self):
        schedule = place([job("huge", 8, "x"), job("one", 1, "y")], [host("h", 4)], {}, {})
        assert schedule.placements == (Placement("one", "h", (0,)),) and schedule.hold is None


class TestHeadHold:
    def test_the_head_holds_its_host_and_later_jobs_may_not_take_its_free_gpus(self):
        hosts = [host("h", 4, busy=(0, 1))]
        schedule = place([job("four", 4, "alice"), job("one", 1, "bob")], hosts, {}, {})
        assert schedule.placements == ()
        assert schedule.hold == Hold("four", "h", needed=4, free=2)

    def test_later_jobs_backfill_onto_other_hosts(self):
        hosts = [host("h", 4, busy=(0, 1)), host("other", 2)]
        schedule = place([job("four", 4, "alice"), job("one", 1, "bob"), job("two", 2, "carol")], hosts, {}, {})
        assert schedule.placements == (Placement("one", "other", (0,)),)
        assert schedule.hold is not None and schedule.hold.worker_id == "h"

    def test_the_held_host_is_the_big_enough_one_with_the_most_free_gpus(self):
        hosts = [host("a", 4, busy=(0, 1, 2)), host("b", 4, busy=(0,)), host("c", 2)]
        schedule = place([job("four", 4)], hosts, {}, {})
        assert schedule.hold == Hold("four", "b", needed=4, free=3)

    def test_jobs_ahead_of_the_head_in_claim_order_are_placed_first(self):
        hosts = [host("h", 4, busy=(0,))]
        schedule = place([job("one", 1, "x"), job("four", 4, "y")], hosts, {}, {})
        assert schedule.placements == (Placement("one", "h", (1,)),)
        assert schedule.hold == Hold("four", "h", needed=4, free=2)

    def test_only_the_first_blocked_job_holds(self):
        hosts = [host("a", 4, busy=(0, 1)), host("b", 4, busy=(0, 1, 2))]
        schedule = place([job("first", 4, "x"), job("second", 4, "y"), job("one", 1, "z")], hosts, {}, {})
        assert schedule.hold is not None and schedule.hold.job_id == "first" and schedule.hold.worker_id == "a"
        assert schedule.placements == (Placement("one", "b", (3,)),)


class TestCapOnGpus:
    def test_running_gpus_plus_the_jobs_must_fit_the_cap(self):
        schedule = place([job("a2", 2, "alice"), job("b1", 1, "bob")], [host("h", 8)], {"alice": 1}, {"alice": 2})
        assert schedule.placements == (Placement("b1", "h", (0,)),)

    def test_a_capped_job_holds_back_its_owners_later_jobs_but_not_others(self):
        jobs = [job("a2", 2, "alice"), job("a1", 1, "alice"), job("b1", 1, "bob")]
        schedule = place(jobs, [host("h", 8)], {"alice": 1}, {"alice": 2})
        assert [p.job_id for p in schedule.placements] == ["b1"]

    def test_the_heads_owner_may_not_start_later_jobs_that_would_eat_its_cap(self):
        jobs = [job("a4", 4, "alice"), job("a1", 1, "alice")]
        schedule = place(jobs, [host("h", 4, busy=(0,)), host("o", 1)], {}, {"alice": 4})
        assert schedule.placements == () and schedule.hold is not None and schedule.hold.job_id == "a4"

    def test_a_job_bigger_than_its_owners_cap_is_passed_over_without_blocking_the_owner(self):
        jobs = [job("a4", 4, "alice"), job("a1", 1, "alice")]
        schedule = place(jobs, [host("h", 4)], {}, {"alice": 2})
        assert schedule.placements == (Placement("a1", "h", (0,)),) and schedule.hold is None

    def test_picks_in_one_pass_count_against_the_cap_together(self):
        jobs = [job("a", 1, "alice"), job("b", 1, "alice"), job("c", 1, "alice")]
        schedule = place(jobs, [host("h", 4)], {}, {"alice": 2})
        assert [p.job_id for p in schedule.placements] == ["a", "b"]


class TestNoStarvation:
    def test_a_four_gpu_job_starts_despite_a_stream_of_one_gpu_jobs(self):
        """One 4-GPU host, always busy with 1-GPU jobs of other users, a new one submitted after
        every end. The 4-GPU job, submitted first among the waiting, holds the host: the GPUs
        the 1-GPU jobs free stay free until it has all four."""
        running: dict[int, str] = {0: "r0", 1: "r1", 2: "r2", 3: "r3"}
        queue = [job("big", 4, "alice")]
        started_big_at = None
        for tick in range(20):
            queue.append(job(f"small{tick}", 1, f"user{tick}"))
            running.pop(tick % 4, None)  # one running job ends per tick
            free = tuple(s for s in range(4) if s not in running)
            schedule = place(queue, [Host("h", (0, 1, 2, 3), free)], {}, {})
            for placement in schedule.placements:
                queue = [j for j in queue if j.job_id != placement.job_id]
                for slot in placement.slots:
                    running[slot] = placement.job_id
                if placement.job_id == "big":
                    started_big_at = tick
            if started_big_at is not None:
                break
        assert started_big_at == 3, "the 4-GPU job waits only for the four jobs running when it arrived"
