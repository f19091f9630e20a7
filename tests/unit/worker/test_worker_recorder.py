"""Trainer events → store rows, and how many transactions a run costs."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import DataError, OperationalError

from core.jobs.models import Checkpoint, Job, JobEvent, StepMetric
from trainer.events import STEP_FIELDS, make_event
from worker.recorder import EventRecorder, apply_events


def _step(n: int, loss: float = 1.0) -> dict:
    fields = {name: None for name in STEP_FIELDS}
    fields.update(step=n, total_steps=10, loss=loss, tokens=64)
    return make_event("step", **fields)


class TestApplyEvents:
    def test_maps_each_event_type_to_its_rows(self, runtime, make_job):
        job_id = make_job("fake:ok")
        events = [
            make_event("plan", hardware={"device": "cpu"}, decisions=[], total_steps=10),
            _step(1, 2.0),
            _step(2, 1.5),
            make_event("eval", step=2, loss=1.7, tokens=128),
            make_event("log", level="info", message="hello"),
            make_event("checkpoint", step=2, path="/x/step-000002", bytes=10, final=False),
            make_event("done", status="succeeded", error_code=None, message=None, adapter_path="/x", steps=2),
        ]
        with runtime.sessionmaker.begin() as session:
            last = apply_events(session, job_id, events)
        with runtime.sessionmaker() as session:
            job = session.get(Job, job_id)
            stored = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).all()
            steps = session.scalars(select(StepMetric).where(StepMetric.job_id == job_id)).all()
            checkpoint = session.get(Checkpoint, (job_id, 2))
        assert [e.type for e in stored] == ["state", "plan", "step", "step", "eval", "log", "checkpoint"]
        assert last == stored[-1].seq == job.last_event_seq == 7
        assert job.plan["hardware"] == {"device": "cpu"} and "type" not in job.plan
        assert (job.progress_step, job.total_steps) == (2, 10)
        assert sorted((s.step, s.loss, s.tokens) for s in steps) == [(1, 2.0, 64), (2, 1.5, 64)]
        assert checkpoint.path == "/x/step-000002" and checkpoint.bytes == 10 and not checkpoint.final
        assert stored[2].data["loss"] == 2.0 and "time" in stored[2].data

    def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(self, runtime, make_job):
        job_id = make_job("fake:ok")
        with runtime.sessionmaker.begin() as session:
            apply_events(session, job_id, [_step(1, 3.0), _step(2, 2.5), _step(3, 2.4)])
        with runtime.sessionmaker.begin() as session:
            apply_events(session, job_id, [_step(2, 2.0), _step(3, 1.9)])
        with runtime.sessionmaker() as session:
            rows = session.execute(
                select(StepMetric.step, StepMetric.loss).where(StepMetric.job_id == job_id).order_by(StepMetric.step)
            ).all()
        assert [tuple(r) for r in rows] == [(1, 3.0), (2, 2.0), (3, 1.9)]

    def test_nothing_stored_for_done_alone(self, runtime, make_job):
        job_id = make_job("fake:ok")
        done = make_event("done", status="failed", error_code="x", message="m", adapter_path=None, steps=0)
        with runtime.sessionmaker.begin() as session:
            assert apply_events(session, job_id, [done]) == 0


class TestBatching:
    def test_many_events_are_written_in_few_transactions(self, runtime, make_job, commits):
        job_id = make_job("fake:ok")
        published: list[int] = []
        recorder = EventRecorder(runtime.sessionmaker, job_id, flush_interval_s=3600, max_batch=100,
                                 publish=lambda _job, seq: published.append(seq))
        commits.clear()
        for n in range(1, 251):
            recorder.add(_step(n))
            if recorder.pending() >= recorder.max_batch:
                recorder.flush()
        recorder.flush()

        assert len(commits) == 3 and recorder.batches_written == 3
        assert published == [101, 201, 251]  # one wake-up per committed batch, the state event is seq 1
        with runtime.sessionmaker() as session:
            assert session.scalar(select(func.count()).select_from(StepMetric).where(StepMetric.job_id == job_id)) == 250

    def test_wait_returns_when_the_interval_is_over(self, runtime, make_job):
        recorder = EventRecorder(runtime.sessionmaker, make_job("fake:ok"), flush_interval_s=0.3, max_batch=2)
        started = time.monotonic()
        recorder.wait()
        assert 0.25 <= time.monotonic() - started < 5
        assert recorder.flush_if_due() == 0  # due, but nothing to write

    def test_wait_returns_early_when_a_batch_is_full(self, runtime, make_job):
        recorder = EventRecorder(runtime.sessionmaker, make_job("fake:ok"), flush_interval_s=30, max_batch=2)
        recorder.add(_step(1))
        recorder.add(_step(2))
        started = time.monotonic()
        recorder.wait(timeout=20)
        assert time.monotonic() - started < 10
        assert recorder.flush_if_due() == 2

    def test_a_lost_connection_keeps_the_events_for_the_next_flush(self, runtime, make_job, monkeypatch):
        import worker.recorder as recorder_module

        job_id = make_job("fake:ok")
        recorder = EventRecorder(runtime.sessionmaker, job_id, flush_interval_s=1)
        real = recorder_module.apply_events

        def unreachable(*args, **kwargs):
            raise OperationalError("INSERT ...", {}, ConnectionError("server closed the connection"))

        monkeypatch.setattr(recorder_module, "apply_events", unreachable)
        recorder.add(_step(1))
        with pytest.raises(OperationalError):
            recorder.flush()
        assert recorder.pending() == 1
        monkeypatch.setattr(recorder_module, "apply_events", real)
        assert recorder.flush() == 1
        assert _count(runtime, StepMetric, job_id) == 1


class TestBadEvents:
    def test_a_refused_event_is_dropped_and_does_not_block_later_ones(self, runtime, make_job, monkeypatch):
        import worker.recorder as recorder_module

        job_id = make_job("fake:ok")
        recorder = EventRecorder(runtime.sessionmaker, job_id, flush_interval_s=1)
        real = recorder_module.apply_events

        def refuse_loss_13(session, job_id, events):
            if any(e.get("loss") == 13.0 for e in events):
                raise DataError("INSERT ...", {}, ValueError("value the column refuses"))
            return real(session, job_id, events)

        monkeypatch.setattr(recorder_module, "apply_events", refuse_loss_13)
        for event in (_step(1), _step(2, loss=13.0), _step(3)):
            recorder.add(event)
        assert recorder.flush() == 3
        recorder.add(_step(4))
        assert recorder.flush() == 1
        assert recorder.pending() == 0 and recorder.events_dropped == 1
        with runtime.sessionmaker() as session:
            steps = session.scalars(select(StepMetric.step).where(StepMetric.job_id == job_id)).all()
        assert sorted(steps) == [1, 3, 4]

    def test_malformed_events_are_dropped_and_nuls_stripped(self, runtime, make_job):
        job_id = make_job("fake:ok")
        events = [
            _step(1),
            {"type": "step"},
            {"type": "step", "step": "not a number"},
            {"type": "checkpoint", "path": "/x"},
            make_event("log", level="info", message="a\u0000b", extra={"k\u0000": ["c\u0000"]}),
            _step(2),
        ]
        with runtime.sessionmaker.begin() as session:
            apply_events(session, job_id, events)
        with runtime.sessionmaker() as session:
            stored = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).all()
            job = session.get(Job, job_id)
        assert [e.type for e in stored] == ["state", "step", "log", "step"]
        assert stored[2].data["message"] == "ab" and stored[2].data["extra"] == {"k": ["c"]}
        assert job.progress_step == 2 and _count(runtime, Checkpoint, job_id) == 0


class TestOwnership:
    def test_a_recorder_whose_claim_was_taken_over_writes_nothing_more(self, runtime, make_job):
        job_id = make_job("fake:ok", status="running", worker_id="w1", attempts=1)
        recorder = EventRecorder(runtime.sessionmaker, job_id, flush_interval_s=1, worker_id="w1", attempt=1)
        recorder.add(_step(1))
        assert recorder.flush() == 1 and not recorder.lost
        with runtime.sessionmaker.begin() as session:  # reaped, then claimed by another worker
            session.execute(update(Job).where(Job.job_id == job_id).values(worker_id="w2", attempts=2))
        before = _count(runtime, JobEvent, job_id)

        recorder.add(_step(2))
        recorder.add(make_event("checkpoint", step=2, path="/x/step-000002", bytes=1, final=False))
        assert recorder.flush() == 0

        assert recorder.lost and recorder.events_dropped == 2
        assert _count(runtime, JobEvent, job_id) == before
        assert _count(runtime, StepMetric, job_id) == 1 and _count(runtime, Checkpoint, job_id) == 0
        assert _job_row(runtime, job_id).progress_step == 1

    def test_a_finished_job_takes_no_more_events_from_its_old_claim(self, runtime, make_job):
        job_id = make_job("fake:ok", status="cancelled", worker_id="w1", attempts=1)
        recorder = EventRecorder(runtime.sessionmaker, job_id, flush_interval_s=1, worker_id="w1", attempt=1)
        recorder.add(_step(1))
        recorder.flush()
        assert recorder.lost and _count(runtime, StepMetric, job_id) == 0


def _count(runtime, model, job_id: str) -> int:
    with runtime.sessionmaker() as session:
        return session.scalar(select(func.count()).select_from(model).where(model.job_id == job_id))


def _job_row(runtime, job_id: str) -> Job:
    with runtime.sessionmaker() as session:
        return session.get(Job, job_id)


class TestRunCost:
    def test_a_whole_run_costs_a_handful_of_transactions(self, runtime, make_job, commits):
        from worker.runner import run_job

        job_id = make_job("fake:ok:300")
        runtime.settings = runtime.settings.model_copy(update={"event_flush_interval_s": 30.0, "heartbeat_interval_s": 30.0})
        commits.clear()
        assert run_job(runtime, job_id) == "succeeded"
        # claim + 2 full batches of 200 (303 events) + final flush + finish + one heartbeat
        assert len(commits) <= 6, len(commits)
