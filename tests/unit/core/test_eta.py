"""Queue start estimates (``core.jobs.eta``): the replay of the queue policy over the hosts' GPUs,
and a job's pace from its step rows."""

from __future__ import annotations

import datetime as dt

import pytest

from core.jobs.eta import Busy, pace_of, replay_starts
from core.jobs.scheduling import Waiting

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def waiting(job_id: str, owner: str | None = None, gpus: int = 1) -> Waiting:
    return Waiting(job_id, owner, "normal", gpus, "m", 10, T0)


class TestReplay:
    def test_idle_gpus_start_jobs_now_and_busy_ones_when_their_job_ends(self):
        jobs = [waiting("a", "x"), waiting("b", "y"), waiting("c", "z")]
        starts = replay_starts({"h1": [0], "h2": [0]}, [Busy("w", 30.0, 1, "h2", (0,))], jobs,
                               {"x": 0, "y": 0, "z": 0}, {"a": 100.0, "b": 10.0, "c": 5.0})
        assert starts == {"a": 0.0, "b": 30.0, "c": 40.0}

    def test_a_capped_owner_waits_for_their_running_job_and_others_pass(self):
        jobs = [waiting("a1", "alice"), waiting("b1", "bob")]
        starts = replay_starts({"h1": [0], "h2": [0]}, [Busy("alice", 50.0)], jobs, {"alice": 1, "bob": 1},
                               {"a1": 10.0, "b1": 10.0})
        assert starts == {"b1": 0.0, "a1": 50.0}

    def test_a_gpu_waits_for_the_next_job_end_when_every_waiting_job_is_capped(self):
        jobs = [waiting("a2", "alice")]
        starts = replay_starts({"h1": [0], "h2": [0]}, [Busy("alice", 80.0, 1, "h2", (0,))], jobs, {"alice": 1},
                               {"a2": 1.0})
        assert starts == {"a2": 80.0}

    def test_an_unknown_end_makes_later_starts_on_that_gpu_unknown(self):
        jobs = [waiting("a"), waiting("b"), waiting("c")]
        starts = replay_starts({"h": [0]}, [], jobs, {None: 0}, {"a": 10.0, "b": None, "c": 1.0})
        assert starts == {"a": 0.0, "b": 10.0, "c": None}

    def test_an_owner_capped_behind_an_unknown_end_stays_unknown(self):
        jobs = [waiting("a2", "alice"), waiting("b1", "bob")]
        starts = replay_starts({"h": [0]}, [Busy("alice", None)], jobs, {"alice": 1, "bob": 1},
                               {"b1": 5.0, "a2": 5.0})
        assert starts == {"b1": 0.0, "a2": None}

    def test_no_host_means_no_estimate(self):
        assert replay_starts({}, [], [waiting("a")], {None: 0}, {"a": 1.0}) == {"a": None}

    def test_a_job_needing_more_gpus_than_any_host_has_never_starts(self):
        starts = replay_starts({"h": [0]}, [], [waiting("big", gpus=2), waiting("small")], {None: 0},
                               {"big": 1.0, "small": 1.0})
        assert starts == {"big": None, "small": 0.0}

    def test_a_multi_gpu_job_starts_when_enough_gpus_of_one_host_are_free(self):
        # h has 4 GPUs: slot 3 is idle, slot 0 frees at 10 s, slots 1-2 at 30 s: 2 free at 10 s.
        running = [Busy("x", 10.0, 1, "h", (0,)), Busy("y", 30.0, 2, "h", (1, 2))]
        starts = replay_starts({"h": [0, 1, 2, 3]}, running, [waiting("two", gpus=2)], {None: 0}, {"two": 5.0})
        assert starts == {"two": 10.0}

    def test_the_heads_hold_delays_later_small_jobs_on_its_host(self):
        # h has 2 GPUs, one busy until 20 s. The 2-GPU head holds h: the 1-GPU job behind it may
        # not take the idle GPU, so it starts after the head (20 s + 5 s), not now.
        running = [Busy("x", 20.0, 1, "h", (0,))]
        jobs = [waiting("head", "alice", gpus=2), waiting("small", "bob")]
        starts = replay_starts({"h": [0, 1]}, running, jobs, {}, {"head": 5.0, "small": 1.0})
        assert starts == {"head": 20.0, "small": 25.0}

    def test_later_small_jobs_backfill_onto_another_host(self):
        running = [Busy("x", 20.0, 1, "big", (0,))]
        jobs = [waiting("head", "alice", gpus=2), waiting("small", "bob")]
        starts = replay_starts({"big": [0, 1], "one": [0]}, running, jobs, {}, {"head": 5.0, "small": 1.0})
        assert starts == {"head": 20.0, "small": 0.0}

    def test_the_cap_counts_gpus(self):
        # alice's cap is 2 GPUs and she runs 1 until 15 s: her 2-GPU job waits until then.
        jobs = [waiting("a2", "alice", gpus=2)]
        starts = replay_starts({"h": [0, 1, 2]}, [Busy("alice", 15.0, 1, "h", (0,))], jobs, {"alice": 2},
                               {"a2": 1.0})
        assert starts == {"a2": 15.0}


class TestPace:
    def test_wall_time_between_rows_over_steps(self):
        rows = [(10, _at(0), 500.0), (14, _at(12), 500.0), (12, _at(5), 500.0)]
        assert pace_of(rows) == pytest.approx(3.0)

    def test_one_row_uses_its_step_time(self):
        assert pace_of([(1, _at(0), 1500.0)]) == pytest.approx(1.5)

    def test_no_rows_is_unknown(self):
        assert pace_of([]) is None
        assert pace_of([(1, _at(0), None)]) is None


class TestReplayAcrossMachines:
    """Multi-machine jobs (``nodes: M``) in the replay: they need M machines with addresses at
    once, and hold a part of every one of them until they end."""

    ADDRESSES = {"h1": "10.0.0.1", "h2": "10.0.0.2"}

    def test_a_two_machine_job_starts_when_both_machines_are_free(self):
        jobs = [Waiting("pair", None, "normal", 2, "m", 10, T0, nodes=2), waiting("after")]
        starts = replay_starts({"h1": [0], "h2": [0]}, [Busy("w", 30.0, 1, "h2", (0,))], jobs, {None: 0},
                               {"pair": 20.0, "after": 5.0}, self.ADDRESSES)
        assert starts == {"pair": 30.0, "after": 50.0}

    def test_a_running_two_machine_job_holds_both_machines(self):
        running = [Busy("w", 40.0, 2, "h1", (0,), (("h2", (0,)),))]
        starts = replay_starts({"h1": [0], "h2": [0]}, running, [waiting("one")], {None: 0}, {"one": 5.0},
                               self.ADDRESSES)
        assert starts == {"one": 40.0}

    def test_without_addresses_a_multi_machine_job_gets_no_estimate(self):
        jobs = [Waiting("pair", None, "normal", 2, "m", 10, T0, nodes=2)]
        assert replay_starts({"h1": [0], "h2": [0]}, [], jobs, {None: 0}, {"pair": 20.0}) == {"pair": None}
