"""The Celery tasks over a Runtime, and the worker row the presence loop keeps."""

from __future__ import annotations

import datetime as dt

import pytest
from celery.exceptions import Reject

from core.db import utcnow
from core.jobs.models import Job
from core.queue import TASK_REAP, TASK_RUN_JOB, make_celery
from core.workers.models import Worker
from worker.presence import Presence, detect_hardware, register


@pytest.fixture
def celery_app(runtime, settings):
    from worker.tasks import register_tasks

    app = make_celery(settings.model_copy(update={"broker_url": "memory://"}))
    register_tasks(app, lambda: runtime)
    return app


class TestTasks:
    def test_jobs_run_runs_the_job_once(self, celery_app, runtime, make_job):
        job_id = make_job("fake:ok:2")
        assert celery_app.tasks[TASK_RUN_JOB].run(job_id) == "succeeded"
        assert celery_app.tasks[TASK_RUN_JOB].run(job_id) == "skipped"

    def test_jobs_run_puts_the_message_back_while_shutting_down(self, celery_app, runtime, make_job):
        job_id = make_job("fake:ok:2")
        runtime.shutdown_event.set()
        with pytest.raises(Reject):
            celery_app.tasks[TASK_RUN_JOB].run(job_id)

    def test_jobs_reap_requeues_a_stale_job(self, celery_app, runtime, make_job):
        stale = utcnow() - dt.timedelta(seconds=600)
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="gone", heartbeat_at=stale)
        assert celery_app.tasks[TASK_REAP].run()["requeued"] == [job_id]
        assert runtime.recorded.enqueued == [job_id]


class TestPresence:
    def test_detect_stores_the_trainers_report(self, runtime):
        report = detect_hardware(runtime)
        assert report["hardware"]["name"] == "fake"
        register(runtime, report)
        with runtime.sessionmaker() as session:
            row = session.get(Worker, "test-host/gpu3")
        assert row.device == "cuda:3" and row.hardware == report and row.current_job_id is None

    def test_a_failing_detect_is_reported_not_raised(self, runtime):
        runtime.options = type(runtime.options)(trainer_argv=("false",), name="x")
        assert "exited with 1" in detect_hardware(runtime)["error"]

    def test_a_registered_worker_wakes_itself_for_the_jobs_it_can_take(self, runtime, make_job):
        # a job submitted while every host was busy got no message (api/jobs/wakeups.py)
        job_id = make_job("fake:ok", updated_at=utcnow() - dt.timedelta(seconds=1))
        register(runtime, {})
        Presence(runtime, detect=False).signal_own()
        assert list(zip(runtime.recorded.enqueued, runtime.recorded.hosts)) == [(job_id, "test-host/gpu3")]

    def test_a_tick_beats_and_reaps(self, runtime, make_job):
        stale = utcnow() - dt.timedelta(seconds=600)
        job_id = make_job("fake:ok", status="running", attempts=1, worker_id="gone", heartbeat_at=stale)
        register(runtime, {})
        with runtime.sessionmaker() as session:
            before = session.get(Worker, "test-host/gpu3").heartbeat_at
        Presence(runtime, detect=False).tick()
        with runtime.sessionmaker() as session:
            assert session.get(Worker, "test-host/gpu3").heartbeat_at > before
            assert session.get(Job, job_id).status == "queued"
