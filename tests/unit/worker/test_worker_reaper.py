"""The reaper: stale running jobs are retried or failed; lost queued messages are re-sent."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select, update

from core.db import utcnow
from core.jobs.models import Job, JobEvent
from core.workers.models import GpuSlot, Worker
from worker.reaper import reap


def _reap(runtime, **kwargs):
    return reap(runtime.sessionmaker, runtime.settings, enqueue=runtime.recorded.enqueue,
                publish=runtime.publish, **kwargs)


def _ago(seconds: float) -> dt.datetime:
    return utcnow() - dt.timedelta(seconds=seconds)


def _job(runtime, job_id):
    with runtime.sessionmaker() as session:
        return session.get(Job, job_id)


def _last_event(runtime, job_id) -> JobEvent:
    with runtime.sessionmaker() as session:
        return session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq.desc())).first()


class TestStaleRunningJobs:
    def test_a_job_with_attempts_left_goes_back_to_the_queue_and_is_resent(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="gone/gpu0", heartbeat_at=_ago(60))

        report = _reap(runtime)

        assert report.requeued == [job_id] and report.failed == []
        job = _job(runtime, job_id)
        assert (job.status, job.worker_id, job.heartbeat_at) == ("queued", None, None)
        assert runtime.recorded.enqueued == [job_id]
        event = _last_event(runtime, job_id)
        assert event.data["status"] == "queued"
        assert "retrying from the last checkpoint after lost worker gone/gpu0" in event.data["reason"]
        assert (job_id, event.seq) in runtime.recorded.published

    def test_a_job_out_of_attempts_fails_with_worker_lost(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", attempts=2, worker_id="gone/gpu0", heartbeat_at=_ago(60))

        report = _reap(runtime)

        assert report.failed == [job_id] and runtime.recorded.enqueued == []
        job = _job(runtime, job_id)
        assert job.status == "failed" and job.error_code == "worker_lost" and job.finished_at is not None
        assert "gave up after 2 attempts" in job.error_message

    def test_a_job_whose_cancel_was_requested_ends_cancelled_not_requeued(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="gone/gpu0", heartbeat_at=_ago(60),
                          cancel_requested=True)

        report = _reap(runtime)

        assert report.cancelled == [job_id] and report.requeued == [] and job_id not in runtime.recorded.enqueued
        job = _job(runtime, job_id)
        assert job.status == "cancelled" and job.finished_at is not None
        event = _last_event(runtime, job_id)
        assert event.data["status"] == "cancelled"
        assert "lost worker gone/gpu0" in event.data["message"] and "after the cancel was requested" in event.data["message"]
        assert (job_id, event.seq) in runtime.recorded.published

    def test_a_job_with_a_fresh_heartbeat_is_left_alone(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="w", heartbeat_at=_ago(1))
        report = _reap(runtime)
        assert report.requeued == report.failed == [] and _job(runtime, job_id).status == "running"

    def test_a_stale_job_of_a_worker_that_still_beats_waits_for_that_worker_to_go_silent(self, runtime, make_job):
        # A dying machine's worker row may beat up to one interval after its job's last beat: the
        # job is reaped once the placement, too, counts that worker as gone (so the retry's
        # message never goes to the dead machine's queue); a job silent for twice the timeout is
        # reaped even beside a beating worker (its job thread hung).
        timeout = runtime.settings.heartbeat_timeout_s
        with runtime.sessionmaker.begin() as session:
            session.add(Worker(worker_id="dying", hostname="m", device="cpu", heartbeat_at=_ago(timeout - 2),
                               started_at=_ago(10 * timeout)))
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="dying", heartbeat_at=_ago(timeout + 1))
        assert _reap(runtime).requeued == [] and _job(runtime, job_id).status == "running"
        with runtime.sessionmaker.begin() as session:
            session.execute(update(Worker).where(Worker.worker_id == "dying").values(heartbeat_at=_ago(timeout + 1)))
        assert _reap(runtime).requeued == [job_id]
        hung = make_job("fake:ok", status="running", attempts=1, worker_id="w", heartbeat_at=_ago(2 * timeout + 1))
        with runtime.sessionmaker.begin() as session:
            session.add(Worker(worker_id="w", hostname="m2", device="cpu", heartbeat_at=_ago(0),
                               started_at=_ago(10 * timeout)))
        assert _reap(runtime).requeued == [hung]

    def test_a_job_of_a_restarted_workers_earlier_life_is_reaped_at_the_timeout(self, runtime, make_job):
        timeout = runtime.settings.heartbeat_timeout_s
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="back", heartbeat_at=_ago(timeout + 1))
        with runtime.sessionmaker.begin() as session:  # the worker came back (same id) and beats again
            session.add(Worker(worker_id="back", hostname="m", device="cpu", heartbeat_at=_ago(0), started_at=_ago(1)))
        assert _reap(runtime).requeued == [job_id]

    def test_a_running_job_that_never_beat_is_stale(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="w", heartbeat_at=None)
        assert _reap(runtime).requeued == [job_id]

    def test_two_reapers_requeue_a_job_once(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="w", heartbeat_at=_ago(60))
        first, second = _reap(runtime), _reap(runtime)
        assert first.requeued == [job_id] and second.requeued == []
        assert runtime.recorded.enqueued == [job_id]


class TestLostQueuedMessages:
    def test_a_host_resends_a_job_placed_on_it_waiting_too_long_once_per_period(self, runtime, make_job):
        job_id = make_job("fake:ok", updated_at=_ago(300))
        runtime.ensure_registered()

        first = _reap(runtime, host=runtime.worker_id, resend_after_s=120)
        second = _reap(runtime, host=runtime.worker_id, resend_after_s=120)

        assert first.resent == [job_id] and second.resent == []
        assert runtime.recorded.enqueued == [job_id] and runtime.recorded.hosts == [runtime.worker_id]
        assert _job(runtime, job_id).status == "queued"

    def test_a_host_without_free_gpus_does_not_resend(self, runtime, make_job):
        runtime.ensure_registered()
        running = make_job("fake:ok", status="running", attempts=1, worker_id=runtime.worker_id, heartbeat_at=_ago(1))
        with runtime.sessionmaker.begin() as session:
            session.execute(update(GpuSlot).values(job_id=running, reserved_at=_ago(1)))
        make_job("fake:ok", updated_at=_ago(300), owner_id=None)
        assert _reap(runtime, host=runtime.worker_id, resend_after_s=120).resent == []

    def test_a_recently_queued_job_is_not_resent(self, runtime, make_job):
        runtime.ensure_registered()
        make_job("fake:ok", updated_at=_ago(5))
        assert _reap(runtime, host=runtime.worker_id, resend_after_s=120).resent == []


class TestGpus:
    def test_a_reaped_jobs_gpus_are_free_again(self, runtime, make_job):
        runtime.ensure_registered()
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="gone", heartbeat_at=_ago(60))
        with runtime.sessionmaker.begin() as session:
            session.execute(update(GpuSlot).values(job_id=job_id, reserved_at=_ago(60)))
        assert _reap(runtime).requeued == [job_id]
        with runtime.sessionmaker() as session:
            assert session.scalars(select(GpuSlot.job_id)).all() == [None]

    def test_gpus_held_by_a_job_that_is_not_running_are_freed(self, runtime, make_job):
        runtime.ensure_registered()
        job_id = make_job("fake:ok", status="succeeded")
        with runtime.sessionmaker.begin() as session:
            session.execute(update(GpuSlot).values(job_id=job_id, reserved_at=_ago(600)))
        _reap(runtime)
        with runtime.sessionmaker() as session:
            assert session.scalars(select(GpuSlot.job_id)).all() == [None]


def test_a_reaped_job_runs_again_on_the_next_delivery(runtime, make_job, settings):
    from worker.runner import run_job

    job_id = make_job("fake:ok:2", status="running", attempts=1, worker_id="gone", heartbeat_at=_ago(60))
    assert run_job(runtime, job_id) == "skipped"  # the redelivered message finds it running
    _reap(runtime)
    assert run_job(runtime, job_id) == "succeeded"
    assert _job(runtime, job_id).attempts == 2
