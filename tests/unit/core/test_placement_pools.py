"""Named pools (a Slurm bridge's host): a job naming a pool starts only on a host serving it, a
job naming none never there; a pooled job of several nodes takes its GPUs of the one bridge host
(Slurm spreads the nodes); ``check_pool`` refuses what the partition can never run."""

from __future__ import annotations

import datetime as dt

import pytest

from core.db import utcnow
from core.errors import Unsupported
from core.jobs.placement import Host, Placement, Waiting, place
from core.workers.models import Worker
from core.workers.pools import check_pool

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def job(job_id: str, gpus: int = 1, nodes: int = 1, pool: str | None = None, owner: str | None = None) -> Waiting:
    return Waiting(job_id, owner, "normal", gpus, "m", 10, T0, None, nodes, None, pool)


def test_pooled_and_ordinary_jobs_keep_to_their_own_hosts():
    hosts = [Host("box", (0, 1), (0, 1)), Host("slurm", (0, 1, 2, 3), (0, 1, 2, 3), None, "slurm")]
    schedule = place([job("on-slurm", pool="slurm"), job("on-box"), job("big", gpus=3)], hosts, {}, {})
    assert schedule.placements == (Placement("on-slurm", "slurm", (0,)), Placement("on-box", "box", (0,)))


def test_a_pooled_job_of_several_nodes_takes_its_gpus_of_the_one_bridge_host():
    hosts = [Host("slurm", (0, 1, 2, 3), (0, 1, 2, 3), None, "slurm")]
    schedule = place([job("spread", gpus=4, nodes=2, pool="slurm")], hosts, {}, {})
    assert schedule.placements == (Placement("spread", "slurm", (0, 1, 2, 3)),)


def test_a_pooled_job_waits_for_its_pool_and_holds_only_its_host():
    hosts = [Host("box", (0,), (0,)), Host("slurm", (0, 1), (), None, "slurm")]
    schedule = place([job("waits", pool="slurm", owner="a"), job("later", owner="b")], hosts, {}, {})
    assert schedule.placements == (Placement("later", "box", (0,)),)
    assert schedule.hold is not None and schedule.hold.worker_id == "slurm"


def test_a_pool_no_host_serves_places_nothing():
    schedule = place([job("nowhere", pool="slurm")], [Host("box", (0, 1), (0, 1))], {}, {})
    assert schedule.placements == () and schedule.hold is None


def _bridge(session, *, nodes: int = 2, per_node: int = 4, unit: str = "gpu") -> None:
    now = utcnow()
    session.add(Worker(worker_id="slurm-gpu@login", hostname="login", device="cpu", started_at=now, heartbeat_at=now,
                       pool="slurm", hardware={"pool": {"kind": "slurm", "partition": "gpu", "nodes": nodes,
                                                        "per_node": per_node, "unit": unit}}))
    session.commit()


def test_check_pool_refuses_more_than_the_partition_has(box):
    maker, _settings = box
    with maker() as session:
        with pytest.raises(Unsupported, match=r"no bridge serves pool 'slurm' \(no pool is known\)") as unknown:
            check_pool(session, "slurm", gpus=1, nodes=1)
        assert unknown.value.param == "pool"
        _bridge(session)
        check_pool(session, "slurm", gpus=8, nodes=2)
        with pytest.raises(Unsupported, match=r"nodes: 3 is more than Slurm partition 'gpu' .*\(2 nodes\)") as nodes:
            check_pool(session, "slurm", gpus=3, nodes=3)
        assert nodes.value.param == "nodes"
        with pytest.raises(Unsupported, match=r"8 per node, more than .*: 4 GPUs each; set gpus to at most 4") as gpus:
            check_pool(session, "slurm", gpus=8, nodes=1)
        assert gpus.value.param == "gpus"
        with pytest.raises(Unsupported, match=r"pools known: slurm"):
            check_pool(session, "k8s", gpus=1, nodes=1)


def test_a_queued_slurm_job_says_slurm_decides_and_only_the_bridge_claims_it(box):
    from types import SimpleNamespace

    from core.jobs import eta, scheduling
    from core.workers.pool import register_pool
    from tests.fixtures.scheduling import add_job

    maker, settings = box
    with maker() as session:
        _bridge(session, nodes=2, per_node=1)
        register_pool(session, "slurm-gpu@login", [None, None])
        session.commit()
    pooled = add_job(SimpleNamespace(sessions=maker), pool="slurm", gpus=2, nodes=2)
    with maker() as session:
        entry = eta.snapshot(session, settings).entry(pooled)
        assert entry is not None and entry.decided_by == "Slurm decides" and entry.estimated_start_at is None
        placement = scheduling.next_placement(session, settings, "slurm-gpu@login")
        assert placement == Placement(pooled, "slurm-gpu@login", (0, 1))
        assert scheduling.try_claim(session, placement, settings)
