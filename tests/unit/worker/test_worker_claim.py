"""The worker claims the next eligible job, not the message's; freed slots re-signal.

The ETA replay the queue shows is tested in tests/unit/core/test_eta.py."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select

from core.db import utcnow
from core.jobs.models import Job
from worker.reaper import reap
from worker.runner import run_job

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def _status(runtime, job_id: str) -> str:
    with runtime.sessionmaker() as session:
        return session.execute(select(Job.status).where(Job.job_id == job_id)).scalar_one()


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


class TestWorkerClaim:
    def test_a_message_runs_the_highest_priority_job_not_the_one_it_names(self, runtime, make_job):
        named = make_job("fake:ok:1", created_at=_at(0))
        urgent = make_job("fake:ok:1", created_at=_at(5), priority="high")
        assert run_job(runtime, named) == "succeeded"
        assert (_status(runtime, urgent), _status(runtime, named)) == ("succeeded", "queued")

    def test_a_message_with_nothing_eligible_is_dropped(self, runtime, make_job):
        make_job("fake:ok", status="running", worker_id="other", heartbeat_at=utcnow(), attempts=1)
        waiting = make_job("fake:ok:1")  # no owner: shares the anonymous cap of 1 with the running job
        assert run_job(runtime, waiting) == "skipped"
        assert _status(runtime, waiting) == "queued"

    def test_a_finished_job_signals_the_job_that_waited_for_its_slot(self, runtime, make_job):
        first = make_job("fake:ok:1", created_at=_at(0))
        second = make_job("fake:ok:1", created_at=_at(1))
        assert run_job(runtime, first) == "succeeded"
        assert runtime.recorded.enqueued == [second]
        assert _status(runtime, second) == "queued"

    def test_nothing_is_signalled_when_nothing_waits(self, runtime, make_job):
        assert run_job(runtime, make_job("fake:ok:1")) == "succeeded"
        assert runtime.recorded.enqueued == []

    def test_the_reaper_signals_the_next_job_when_it_fails_a_lost_one(self, runtime, make_job, settings):
        stale = utcnow() - dt.timedelta(seconds=600)
        lost = make_job("fake:ok", status="running", attempts=settings.max_attempts, worker_id="gone",
                        heartbeat_at=stale)
        waiting = make_job("fake:ok:1")
        runtime.ensure_registered()  # a live host with a free GPU to place the waiting job on
        report = reap(runtime.sessionmaker, settings, enqueue=runtime.enqueue)
        assert report.failed == [lost] and report.signalled == [waiting]
        assert runtime.recorded.enqueued == [waiting] and runtime.recorded.hosts == [runtime.worker_id]
