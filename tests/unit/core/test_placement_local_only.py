"""Jobs that read and write the API's data directory (chat sessions, generation jobs, eval runs)
start only on a local host (no worker key): a remote host is never given one, and a box whose
every live host is remote refuses them at submission, naming what they need."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import pytest

from core.db import utcnow
from core.errors import Unsupported
from core.jobs.placement import Host, Placement, Waiting, place
from core.workers.keys import create_worker_key
from core.workers.models import Worker
from core.workers.pool import register_pool

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def job(job_id: str, kind: str = "train", gpus: int = 1, owner: str | None = None) -> Waiting:
    return Waiting(job_id, owner, "normal", gpus, "m", 10, T0, None, 1, None, None, "lora", kind)


@pytest.mark.parametrize("kind", ["session", "generate", "eval"])
def test_a_job_of_the_api_data_dir_skips_a_remote_host_even_when_it_fits_best(kind):
    hosts = [Host("remote", (0,), (0,), remote=True), Host("local", (0, 1), (0, 1))]
    schedule = place([job("j", kind)], hosts, {}, {})
    assert schedule.placements == (Placement("j", "local", (0,)),)


def test_training_still_uses_remote_hosts_and_local_only_kinds_wait_for_a_local_one():
    hosts = [Host("remote", (0, 1), (0, 1), remote=True), Host("local", (0,), ())]
    schedule = place([job("gen", "generate", owner="a"), job("train", owner="b")], hosts, {}, {})
    assert schedule.placements == (Placement("train", "remote", (0,)),)
    assert schedule.hold is not None and schedule.hold.job_id == "gen" and schedule.hold.worker_id == "local"


def test_with_only_remote_hosts_a_session_is_placed_nowhere_and_holds_nothing():
    hosts = [Host("remote", (0, 1), (0, 1), remote=True)]
    schedule = place([job("chat", "session"), job("train")], hosts, {}, {})
    assert schedule.placements == (Placement("train", "remote", (0,)),) and schedule.hold is None


def _worker(session, worker_id: str, *, remote: bool) -> None:
    key_id = None
    if remote:
        key, _raw = create_worker_key(session, f"key-{worker_id}", created_by=None)
        session.flush()
        key_id = key.worker_key_id
    now = utcnow()
    session.add(Worker(worker_id=worker_id, hostname=worker_id, device="cpu", started_at=now, heartbeat_at=now,
                       key_id=key_id))
    session.flush()
    register_pool(session, worker_id, [None])
    session.commit()


def test_the_store_marks_keyed_hosts_remote_and_the_claim_skips_them(box):
    from core.jobs import scheduling
    from tests.fixtures.scheduling import add_job

    maker, settings = box
    with maker() as session:
        _worker(session, "a-remote", remote=True)
        _worker(session, "b-local", remote=False)
    generation = add_job(SimpleNamespace(sessions=maker), kind="generate")
    with maker() as session:
        assert scheduling.next_placement(session, settings, "a-remote") is None
        assert scheduling.next_placement(session, settings, "b-local") == Placement(generation, "b-local", (0,))


def test_submission_says_what_a_local_only_kind_needs_when_every_host_is_remote(box):
    from core.jobs.scheduling import check_gpus

    maker, settings = box
    with maker() as session:
        check_gpus(session, 1, settings, kind="session")  # no live host: accepted, it waits
        _worker(session, "gpubox2", remote=True)
        check_gpus(session, 1, settings, kind="train")
        for kind, what in (("session", "a chat session"), ("generate", "a generation job"), ("eval", "an eval run")):
            with pytest.raises(Unsupported, match=rf"{what} needs a worker that shares the API's data directory.*"
                                                  r"gpubox2") as refused:
                check_gpus(session, 1, settings, kind=kind)
            assert refused.value.param == "gpus"
        _worker(session, "mainbox", remote=False)
        check_gpus(session, 1, settings, kind="generate")
