"""The queue policy for full fine-tuning across machines (``method: full``, ``nodes > 1``): its
machines must share one checkpoint directory (``Host.shared``: the same FTQ_SHARED_DIR path and
marker id), so it is placed, and holds, within one storage; a job of adapters is not bound to one; a
retry whose checkpoints are in a shared storage (never uploaded) stays on that storage, whatever its method."""

from __future__ import annotations

import dataclasses
import datetime as dt

from core.jobs.placement import Hold, Host, Waiting, place

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
NFS = ("/shared", "id-nfs")
CEPH = ("/shared", "id-ceph")
"""Same path, another filesystem (another marker id): not the same directory."""


def job(job_id: str, gpus: int = 2, nodes: int = 2, method: str = "full", owner: str | None = None) -> Waiting:
    return Waiting(job_id, owner, "normal", gpus, "m", 10, T0, None, nodes, None, method=method)


def host(name: str, address: str, shared: tuple[str, str] | None, size: int = 1,
         busy: tuple[int, ...] = ()) -> Host:
    slots = tuple(range(size))
    return Host(name, slots, tuple(s for s in slots if s not in busy), address, shared=shared)


class TestFullFineTuningAcrossMachines:
    def test_it_takes_two_machines_of_one_storage(self):
        hosts = [host("a", "10.0.0.1", NFS), host("b", "10.0.0.2", CEPH), host("c", "10.0.0.3", NFS)]
        [placed] = place([job("j")], hosts, {}, {}).placements
        assert [p.worker_id for p in placed.parts] == ["a", "c"]

    def test_machines_of_two_storages_or_without_one_are_not_enough(self):
        hosts = [host("a", "10.0.0.1", NFS), host("b", "10.0.0.2", CEPH), host("c", "10.0.0.3", None)]
        schedule = place([job("j"), job("small", gpus=1, nodes=1, method="lora", owner="o")], hosts, {}, {})
        assert [p.job_id for p in schedule.placements] == ["small"]
        assert schedule.hold is None, "no storage has 2 machines: too big, it holds nothing"

    def test_the_same_path_with_another_marker_is_another_storage(self):
        hosts = [host("a", "10.0.0.1", NFS), host("b", "10.0.0.2", CEPH)]
        assert place([job("j")], hosts, {}, {}).placements == ()

    def test_it_waits_holding_machines_of_one_storage(self):
        hosts = [host("a", "10.0.0.1", NFS, size=2, busy=(0, 1)), host("b", "10.0.0.2", NFS, size=2),
                 host("c", "10.0.0.3", CEPH, size=2), host("d", "10.0.0.4", None, size=2)]
        schedule = place([job("j", gpus=4)], hosts, {}, {})
        assert schedule.placements == ()
        assert schedule.hold is not None and schedule.hold.hosts == frozenset({"a", "b"}), schedule.hold
        assert schedule.hold == Hold("j", "b", needed=2, free=2, also=("a",))

    def test_best_fit_picks_the_storage_whose_machines_have_fewest_free(self):
        hosts = [host("n1", "10.0.0.1", NFS, size=4), host("n2", "10.0.0.2", NFS, size=4),
                 host("c1", "10.0.0.3", CEPH, size=4, busy=(0, 1, 2)), host("c2", "10.0.0.4", CEPH, size=4, busy=(0, 1))]
        [placed] = place([job("j")], hosts, {}, {}).placements
        assert [p.worker_id for p in placed.parts] == ["c1", "c2"]


class TestAdaptersAcrossMachines:
    def test_lora_spans_machines_with_or_without_shared_storage(self):
        hosts = [host("a", "10.0.0.1", NFS), host("b", "10.0.0.2", None)]
        [placed] = place([job("j", method="lora")], hosts, {}, {}).placements
        assert [p.worker_id for p in placed.parts] == ["a", "b"]

    def test_full_fine_tuning_on_one_machine_needs_no_shared_storage(self):
        [placed] = place([job("j", gpus=2, nodes=1)], [host("a", "10.0.0.1", None, size=2)], {}, {}).placements
        assert placed.worker_id == "a" and placed.followers == ()


def retry(job_id: str, storage: tuple[str, str] | None, method: str = "full", gpus: int = 2) -> Waiting:
    """A queued retry whose newest checkpoint is in ``storage`` (never uploaded); its machines are live."""
    return dataclasses.replace(job(job_id, gpus=gpus, method=method), attempts=1, storage=storage)


class TestARetryStaysWithItsCheckpoints:
    """A retry whose newest checkpoint is in a shared storage and was never uploaded starts only
    on machines of that storage: elsewhere the checkpoint cannot be read."""

    def test_not_on_machines_of_another_storage_even_where_the_fit_is_better(self):
        hosts = [host("c1", "10.0.0.3", CEPH), host("c2", "10.0.0.4", CEPH),
                 host("n1", "10.0.0.1", NFS, size=2), host("n2", "10.0.0.2", NFS, size=2)]
        [placed] = place([retry("j", NFS)], hosts, {}, {}).placements
        assert [p.worker_id for p in placed.parts] == ["n1", "n2"]

    def test_with_none_of_its_storage_live_it_waits_holding_nothing(self):
        hosts = [host("c1", "10.0.0.3", CEPH), host("c2", "10.0.0.4", CEPH), host("d", "10.0.0.5", None)]
        schedule = place([retry("j", NFS), job("small", gpus=1, nodes=1, owner="o")], hosts, {}, {})
        assert [p.job_id for p in schedule.placements] == ["small"] and schedule.hold is None

    def test_adapters_too_whose_checkpoints_are_in_a_shared_directory(self):
        hosts = [host("a", "10.0.0.1", None), host("b", "10.0.0.2", None)]
        assert place([retry("j", NFS, method="lora")], hosts, {}, {}).placements == ()
        assert place([retry("j", None, method="lora")], hosts, {}, {}).placements != (), "uploaded: any machine"

    def test_it_holds_machines_of_its_storage_when_they_are_busy(self):
        hosts = [host("n1", "10.0.0.1", NFS, busy=(0,)), host("n2", "10.0.0.2", NFS),
                 host("c1", "10.0.0.3", CEPH, size=2), host("c2", "10.0.0.4", CEPH, size=2)]
        schedule = place([retry("j", NFS)], hosts, {}, {})
        assert schedule.placements == () and schedule.hold is not None
        assert schedule.hold.hosts == frozenset({"n1", "n2"})
