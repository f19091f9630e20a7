"""The queue policy for jobs that span machines (``nodes > 1``): gpus/nodes GPUs on each of
``nodes`` distinct machines (distinct addresses), all or none, the leader first by address, the
head holding ``nodes`` machines, and no starvation over time."""

from __future__ import annotations

import datetime as dt

from core.jobs.placement import Hold, Host, Part, Placement, Waiting, place

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def job(job_id: str, gpus: int = 1, owner: str | None = None, nodes: int = 1) -> Waiting:
    return Waiting(job_id, owner, "normal", gpus, "m", 10, T0, None, nodes)


def host(name: str, size: int, address: str | None, busy: tuple[int, ...] = ()) -> Host:
    slots = tuple(range(size))
    return Host(name, slots, tuple(s for s in slots if s not in busy), address)


class TestFitAcrossMachines:
    def test_a_job_takes_its_share_on_each_machine_and_the_first_address_leads(self):
        hosts = [host("a-host", 2, "10.0.0.9"), host("z-host", 2, "10.0.0.10")]
        schedule = place([job("j", 4, nodes=2)], hosts, {}, {})
        # "10.0.0.10" < "10.0.0.9" as strings: c10d sorts node addresses as strings
        assert schedule.placements == (
            Placement("j", "z-host", (0, 1), (Part("a-host", (0, 1), "10.0.0.9"),), "10.0.0.10"),
        )
        assert [p.worker_id for p in schedule.placements[0].parts] == ["z-host", "a-host"]
        assert schedule.placements[0].gpus == 4

    def test_all_or_none_when_one_machine_lacks_its_share(self):
        hosts = [host("h1", 2, "10.0.0.1"), host("h2", 2, "10.0.0.2", busy=(0,))]
        schedule = place([job("j", 4, "x", nodes=2)], hosts, {}, {})
        assert schedule.placements == ()
        assert schedule.hold == Hold("j", "h1", needed=2, free=2, also=("h2",))

    def test_two_hosts_at_one_address_are_one_machine(self):
        hosts = [host("h1", 2, "10.0.0.1"), host("h2", 2, "10.0.0.1")]
        schedule = place([job("j", 2, nodes=2), job("one", 1, "y")], hosts, {}, {})
        assert [p.job_id for p in schedule.placements] == ["one"]
        assert schedule.hold is None, "fewer machines than nodes: too big, it holds nothing"

    def test_hosts_without_an_address_take_no_part(self):
        hosts = [host("h1", 2, "10.0.0.1"), host("h2", 2, None)]
        assert place([job("j", 2, nodes=2)], hosts, {}, {}).placements == ()

    def test_best_fit_takes_the_machines_with_the_fewest_free_gpus(self):
        hosts = [host("full", 4, "10.0.0.1"), host("tight", 4, "10.0.0.2", busy=(0, 1, 2)),
                 host("half", 4, "10.0.0.3", busy=(0, 1))]
        [placed] = place([job("j", 2, nodes=2)], hosts, {}, {}).placements
        assert [(p.worker_id, p.slots) for p in placed.parts] == [("tight", (3,)), ("half", (2,))]

    def test_a_machine_smaller_than_the_share_is_not_used(self):
        hosts = [host("small", 1, "10.0.0.1"), host("b", 2, "10.0.0.2"), host("c", 2, "10.0.0.3")]
        [placed] = place([job("j", 4, nodes=2)], hosts, {}, {}).placements
        assert [p.worker_id for p in placed.parts] == ["b", "c"]

    def test_the_cap_counts_every_machines_gpus(self):
        hosts = [host("h1", 2, "10.0.0.1"), host("h2", 2, "10.0.0.2")]
        assert place([job("j", 4, "x", nodes=2)], hosts, {"x": 1}, {"x": 4}).placements == ()
        assert len(place([job("j", 4, "x", nodes=2)], hosts, {}, {"x": 4}).placements) == 1


class TestHeadAcrossMachines:
    def test_the_head_holds_its_machines_and_later_jobs_backfill_elsewhere(self):
        hosts = [host("h1", 2, "10.0.0.1", busy=(0,)), host("h2", 2, "10.0.0.2"), host("h3", 2, "10.0.0.3", busy=(0, 1))]
        schedule = place([job("big", 4, "alice", nodes=2), job("one", 1, "bob")], hosts, {}, {})
        assert schedule.hold == Hold("big", "h2", needed=2, free=2, also=("h1",))
        assert schedule.placements == (), "the held machines' free GPUs stay free; h3 has none"
        hosts[2] = host("h3", 2, "10.0.0.3", busy=(0,))
        schedule = place([job("big", 4, "alice", nodes=2), job("one", 1, "bob")], hosts, {}, {})
        assert schedule.placements == (Placement("one", "h3", (1,)),)

    def test_a_multi_machine_job_starving_under_one_gpu_jobs_starts_once_its_machines_drain(self):
        """Two 2-GPU machines busy with 1-GPU jobs of other users, one ending and one more
        submitted every tick: the 2-machine job holds both machines and starts once the four
        jobs running when it arrived have ended."""
        running = {("h1", 0): "r0", ("h1", 1): "r1", ("h2", 0): "r2", ("h2", 1): "r3"}
        order = list(running)
        queue = [job("big", 4, "alice", nodes=2)]
        started_at = None
        for tick in range(20):
            queue.append(job(f"small{tick}", 1, f"user{tick}"))
            running.pop(order[tick % 4], None)
            hosts = [Host(w, (0, 1), tuple(s for s in (0, 1) if (w, s) not in running), f"10.0.0.{w[-1]}")
                     for w in ("h1", "h2")]
            for placement in place(queue, hosts, {}, {}).placements:
                queue = [j for j in queue if j.job_id != placement.job_id]
                for part in placement.parts:
                    running.update({(part.worker_id, s): placement.job_id for s in part.slots})
                if placement.job_id == "big":
                    started_at = tick
            if started_at is not None:
                break
        assert started_at == 3


def test_one_machine_jobs_keep_their_placement_shape():
    [placed] = place([job("a", 2)], [host("h", 4, "10.0.0.1")], {}, {}).placements
    assert placed.parts == (Part("h", (0, 1)),) and placed.followers == () and placed.address is None
