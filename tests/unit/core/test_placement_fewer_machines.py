"""The placement's ``fewer`` rule: a queued retry of a multi-machine job whose full set of
machines is not live may resume on fewer (down to one, the same GPUs on each), only after its
missing machines have been gone ``shrink_after_s``, only within the storage its checkpoints are in."""

from __future__ import annotations

import dataclasses
import datetime as dt

from core.jobs.placement import Host, Waiting, allow_shrink, may_shrink, place

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
NFS = ("/shared", "id-nfs")
CEPH = ("/shared", "id-ceph")
GRACE = 120.0


def job(job_id: str = "j", gpus: int = 2, nodes: int = 2, method: str = "full", attempts: int = 1,
        lost_for_s: float | None = GRACE, storage: tuple[str, str] | None = NFS) -> Waiting:
    lost_since = None if lost_for_s is None else T0 - dt.timedelta(seconds=lost_for_s)
    return Waiting(job_id, None, "normal", gpus, "m", 10, T0, None, nodes, None, method=method, attempts=attempts,
                   lost_since=lost_since, storage=storage)


def host(name: str, address: str, shared: tuple[str, str] | None = NFS, size: int = 1,
         busy: tuple[int, ...] = ()) -> Host:
    slots = tuple(range(size))
    return Host(name, slots, tuple(s for s in slots if s not in busy), address, shared=shared)


def placed(waiting: list[Waiting], hosts: list[Host]) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    schedule = place(allow_shrink(waiting, T0, GRACE), hosts, {}, {})
    return [(p.job_id, [(part.worker_id, part.slots) for part in p.parts]) for p in schedule.placements]


class TestMayShrink:
    def test_a_retry_whose_machines_are_gone_for_the_grace(self):
        assert may_shrink(job(), T0, GRACE)
        assert may_shrink(job(lost_for_s=0), T0, 0), "0: at once"

    def test_not_before_the_grace(self):
        assert not may_shrink(job(lost_for_s=GRACE - 1), T0, GRACE)

    def test_not_a_first_attempt(self):
        assert not may_shrink(job(attempts=0), T0, GRACE)

    def test_not_when_no_machine_of_its_attempt_is_missing(self):
        assert not may_shrink(job(lost_for_s=None), T0, GRACE)

    def test_not_a_job_of_one_machine_nor_of_a_pool(self):
        assert not may_shrink(job(gpus=1, nodes=1), T0, GRACE)
        assert not may_shrink(dataclasses.replace(job(), pool="slurm"), T0, GRACE), "the cluster places a pool's nodes"

    def test_adapters_and_full_fine_tuning_alike(self):
        assert all(may_shrink(job(method=method), T0, GRACE) for method in ("lora", "qlora", "full"))
        assert not may_shrink(job(method="other"), T0, GRACE)


class TestFewerMachines:
    def test_it_resumes_on_the_one_machine_left_of_its_storage(self):
        hosts = [host("b", "10.0.0.2")]
        assert placed([job()], hosts) == [("j", [("b", (0,))])]

    def test_on_as_many_machines_as_are_live_the_same_gpus_on_each(self):
        hosts = [host(name, f"10.0.0.{i}", size=2) for i, name in enumerate("abc", 1)]
        [(job_id, parts)] = placed([job(gpus=8, nodes=4)], hosts)
        assert [w for w, _ in parts] == ["a", "b", "c"] and all(len(slots) == 2 for _, slots in parts)

    def test_not_before_the_grace_nor_on_a_first_attempt(self):
        hosts = [host("b", "10.0.0.2")]
        assert placed([job(lost_for_s=GRACE - 1)], hosts) == []
        assert placed([job(attempts=0)], hosts) == []

    def test_the_full_set_when_it_is_live(self):
        hosts = [host("a", "10.0.0.1"), host("b", "10.0.0.2"), host("c", "10.0.0.3")]
        [(_, parts)] = placed([job()], hosts)
        assert len(parts) == 2

    def test_busy_machines_are_waited_for_not_shrunk_around(self):
        hosts = [host("a", "10.0.0.1", busy=(0,)), host("b", "10.0.0.2")]
        schedule = place(allow_shrink([job()], T0, GRACE), hosts, {}, {})
        assert schedule.placements == () and schedule.hold is not None and schedule.hold.hosts == {"a", "b"}

    def test_only_within_the_storage_its_checkpoints_are_in(self):
        assert placed([job()], [host("b", "10.0.0.2", shared=CEPH), host("c", "10.0.0.3", shared=None)]) == []
        assert placed([job()], [host("b", "10.0.0.2", shared=CEPH), host("c", "10.0.0.3")]) == [("j", [("c", (0,))])]

    def test_checkpoints_in_the_store_may_resume_on_any_machine(self):
        hosts = [host("b", "10.0.0.2", shared=None)]
        assert placed([job(method="lora", storage=None)], hosts) == [("j", [("b", (0,))])]

    def test_never_below_one_machine(self):
        assert placed([job()], [host("b", "10.0.0.2", size=0)]) == []
        assert placed([job(gpus=4, nodes=2)], [host("b", "10.0.0.2", size=1)]) == [], "2 GPUs a machine, 1 here"

    def test_a_later_job_does_not_take_the_machine_it_waits_for(self):
        hosts = [host("b", "10.0.0.2", busy=(0,))]
        other = Waiting("k", "o", "normal", 1, "m", 10, T0 + dt.timedelta(seconds=1))
        schedule = place(allow_shrink([job(), other], T0, GRACE), hosts + [host("c", "10.0.0.3", shared=None)], {}, {})
        assert schedule.hold is not None and schedule.hold.job_id == "j" and schedule.hold.hosts == {"b"}
        assert [p.worker_id for p in schedule.placements] == ["c"]
