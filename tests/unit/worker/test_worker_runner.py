"""The job runner against the fake trainer: claim, events, exits, cancel, shutdown."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from sqlalchemy import select, update

from core.jobs.models import Checkpoint, Job, JobEvent, StepMetric
from trainer.config import TrainConfig
from trainer.events import BASE_STEP_FIELDS
from worker.runner import run_job


def _job(runtime, job_id: str) -> Job:
    with runtime.sessionmaker() as session:
        return session.get(Job, job_id)


def _events(runtime, job_id: str) -> list[JobEvent]:
    with runtime.sessionmaker() as session:
        return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)))


def _set_when(runtime, job_id: str, predicate, **values) -> threading.Thread:
    """In the background: once ``predicate(job)`` holds, update the job row with ``values``."""

    def watch() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if predicate(_job(runtime, job_id)):
                with runtime.sessionmaker.begin() as session:
                    session.execute(update(Job).where(Job.job_id == job_id).values(**values))
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


class TestSuccess:
    def test_a_good_run_stores_its_events_metrics_and_final_state(self, runtime, make_job):
        job_id = make_job("fake:ok:5")

        assert run_job(runtime, job_id) == "succeeded"

        job = _job(runtime, job_id)
        assert job.status == "succeeded"
        assert (job.attempts, job.worker_id, job.progress_step, job.total_steps) == (1, "test-host/gpu3", 5, 5)
        assert {d["name"]: d["backend"] for d in job.plan["decisions"]}["attention"] == "sdpa"
        assert job.started_at is not None and job.finished_at is not None
        types = [(e.seq, e.type) for e in _events(runtime, job_id)]
        assert [t for _, t in types] == ["state", "state", "plan"] + ["step"] * 5 + ["log", "checkpoint", "state"]
        assert [s for s, _ in types] == list(range(1, len(types) + 1))
        final = _events(runtime, job_id)[-1].data
        assert final["status"] == "succeeded" and final["adapter_path"].endswith("adapter") and final["steps"] == 5
        assert job.last_event_seq == len(types)

    def test_step_rows_carry_every_metric_field(self, runtime, make_job):
        job_id = make_job("fake:ok:3")
        run_job(runtime, job_id)
        with runtime.sessionmaker() as session:
            rows = list(session.scalars(select(StepMetric).where(StepMetric.job_id == job_id).order_by(StepMetric.step)))
            checkpoint = session.get(Checkpoint, (job_id, 3))
        assert [r.step for r in rows] == [1, 2, 3]
        for name in set(BASE_STEP_FIELDS) - {"step", "total_steps"}:  # the objectives': in rows[0].metrics
            assert hasattr(rows[0], name), name
        assert rows[0].loss == 4.9 and rows[0].tokens == 100 and rows[0].host_rss == 123456
        assert rows[0].mfu is None and rows[0].gpu_mem_peak is None
        assert checkpoint is not None and checkpoint.final and checkpoint.bytes == 42

    def test_writes_job_json_and_pins_the_gpu(self, runtime, make_job, settings):
        job_id = make_job("fake:ok:1")
        run_job(runtime, job_id)
        out = settings.jobs_dir / job_id
        config = TrainConfig.load(out / "job.json")
        assert config.output_dir == str(out) and config.job_id == job_id
        assert (out / "cuda.txt").read_text() == "3"
        assert _job(runtime, job_id).output_dir == str(out)

    def test_publishes_after_each_batch(self, runtime, make_job):
        job_id = make_job("fake:ok:3")
        run_job(runtime, job_id)
        seqs = [seq for jid, seq in runtime.recorded.published if jid == job_id]
        assert seqs == sorted(seqs) and seqs[-1] == _job(runtime, job_id).last_event_seq


class TestRedelivery:
    def test_a_second_delivery_of_the_same_job_does_not_run_it_again(self, runtime, make_job, settings):
        job_id = make_job("fake:ok:2")

        assert run_job(runtime, job_id) == "succeeded"
        assert run_job(runtime, job_id) == "skipped"

        assert len((settings.jobs_dir / job_id / "runs.txt").read_text().splitlines()) == 1
        assert _job(runtime, job_id).attempts == 1

    def test_a_job_cancelled_while_queued_never_starts(self, runtime, make_job, settings):
        job_id = make_job("fake:ok:2", status="cancelled")
        assert run_job(runtime, job_id) == "skipped"
        assert not (settings.jobs_dir / job_id / "runs.txt").exists()

    def test_an_unknown_job_is_dropped(self, runtime):
        assert run_job(runtime, "job-000000000000000000000000") == "skipped"


class TestFailures:
    def test_a_crash_fails_the_job_with_the_stderr_tail(self, runtime, make_job):
        job_id = make_job("fake:crash")

        assert run_job(runtime, job_id) == "failed"

        job = _job(runtime, job_id)
        assert job.error_code == "trainer_crashed"
        assert "exited with code 3" in job.error_message
        assert "RuntimeError: corrupt weights in model.safetensors" in job.error_message
        assert job.progress_step == 2  # the steps before the crash were stored
        assert _events(runtime, job_id)[-1].data["error_code"] == "trainer_crashed"

    def test_a_sigkill_the_kernel_did_not_count_as_oom_is_retried_then_fails_as_killed(self, runtime, make_job):
        """The fake trainer SIGKILLs itself: /proc/vmstat's oom_kill does not move (issue 10)."""
        job_id = make_job("fake:sigkill")
        assert run_job(runtime, job_id) == "queued"  # attempt 1 of max_attempts=2
        job = _job(runtime, job_id)
        assert job.attempts == 1 and job.worker_id is None
        retried = _events(runtime, job_id)[-1].data
        assert retried["error_code"] == "killed" and "from outside ftq" in retried["message"]
        assert run_job(runtime, job_id) == "failed"
        job = _job(runtime, job_id)
        assert job.error_code == "killed" and "attempt 2 of 2" in job.error_message

    def test_a_reported_failure_keeps_the_trainers_code_and_message(self, runtime, make_job):
        job_id = make_job("fake:fail")
        assert run_job(runtime, job_id) == "failed"
        job = _job(runtime, job_id)
        assert job.error_code == "data_error" and "line 3 of train.jsonl" in job.error_message

    def test_exit_zero_without_a_final_event_is_a_crash(self, runtime, make_job):
        job_id = make_job("fake:silent_ok")
        assert run_job(runtime, job_id) == "failed"
        assert _job(runtime, job_id).error_code == "trainer_crashed"

    def test_a_spec_that_no_longer_translates_fails_before_spawning(self, runtime, make_job, settings):
        def refuse(*_args, **_kwargs):
            raise ValueError("dataset file-x was deleted")

        runtime.config_builder = refuse
        job_id = make_job("fake:ok")
        assert run_job(runtime, job_id) == "failed"
        job = _job(runtime, job_id)
        assert job.error_code == "invalid_job" and "was deleted" in job.error_message
        assert not (settings.jobs_dir / job_id / "runs.txt").exists()

    def test_the_worker_takes_the_next_job_after_a_crash(self, runtime, make_job):
        crashed, good = make_job("fake:crash"), make_job("fake:ok:2")
        assert run_job(runtime, crashed) == "failed"
        assert run_job(runtime, good) == "succeeded"


class TestCancel:
    def test_a_cooperative_trainer_checkpoints_and_the_job_ends_cancelled(self, runtime, make_job):
        job_id = make_job("fake:cooperative")
        _set_when(runtime, job_id, lambda job: job.progress_step >= 3, cancel_requested=True)

        assert run_job(runtime, job_id) == "cancelled"

        job = _job(runtime, job_id)
        assert job.error_code is None and job.error_message is None and job.finished_at is not None
        with runtime.sessionmaker() as session:
            assert session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()

    def test_a_trainer_that_ignores_sigterm_is_killed_with_its_group_after_the_grace(
        self, runtime, make_job, settings
    ):
        job_id = make_job("fake:stubborn")
        _set_when(runtime, job_id, lambda job: job.progress_step >= 2, cancel_requested=True)

        started = time.monotonic()
        assert run_job(runtime, job_id) == "cancelled"
        elapsed = time.monotonic() - started

        assert elapsed >= settings.cancel_grace_s
        assert "did not stop within cancel_grace_s" in _events(runtime, job_id)[-1].data["message"]
        grandchild = int((settings.jobs_dir / job_id / "grandchild.pid").read_text())
        deadline = time.monotonic() + 5
        while _pid_alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(grandchild), "the trainer's grandchild survived the group kill"

    def test_a_worker_shutdown_hands_the_job_back_to_the_queue(self, runtime, make_job):
        job_id = make_job("fake:cooperative")

        def shut_down_soon() -> None:
            while _job(runtime, job_id).progress_step < 2:
                time.sleep(0.02)
            runtime.shutdown_event.set()

        threading.Thread(target=shut_down_soon, daemon=True).start()
        assert run_job(runtime, job_id) == "queued"
        job = _job(runtime, job_id)
        assert job.worker_id is None and job.heartbeat_at is None and job.attempts == 0
        assert runtime.recorded.enqueued == [job_id]
        assert "resumes from its last checkpoint" in _events(runtime, job_id)[-1].data["message"]

    def test_a_lost_claim_stops_the_trainer_and_leaves_the_job_alone(self, runtime, make_job):
        job_id = make_job("fake:cooperative")
        _set_when(runtime, job_id, lambda job: job.progress_step >= 2, status="queued", worker_id=None)

        assert run_job(runtime, job_id) == "queued"
        assert _job(runtime, job_id).status == "queued"
        assert runtime.recorded.enqueued == []

    def test_a_worker_whose_job_was_claimed_by_another_writes_nothing_into_it(self, runtime, make_job):
        job_id = make_job("fake:cooperative")
        seen: dict = {}

        def take_over() -> None:  # the reaper requeued it and another worker claimed it, in one go
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if _job(runtime, job_id).progress_step >= 2:
                    with runtime.sessionmaker.begin() as session:
                        session.execute(update(Job).where(Job.job_id == job_id).values(worker_id="other/gpu0", attempts=2))
                        seen["events"] = session.scalar(select(Job.last_event_seq).where(Job.job_id == job_id))
                        seen["progress"] = session.scalar(select(Job.progress_step).where(Job.job_id == job_id))
                    return
                time.sleep(0.02)

        thread = threading.Thread(target=take_over, daemon=True)
        thread.start()
        assert run_job(runtime, job_id) == "running"
        thread.join()

        job = _job(runtime, job_id)
        assert (job.status, job.worker_id, job.attempts) == ("running", "other/gpu0", 2)
        assert job.last_event_seq == seen["events"] and len(_events(runtime, job_id)) == seen["events"]
        assert job.progress_step == seen["progress"]
        with runtime.sessionmaker() as session:
            assert session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all() == []
            steps = session.scalars(select(StepMetric.step).where(StepMetric.job_id == job_id)).all()
        assert max(steps) == seen["progress"]

    def test_a_worker_cut_off_from_the_store_kills_its_trainer_and_leaves_the_job(
        self, runtime, make_job, monkeypatch
    ):
        from worker.runner import Watchdog

        runtime.settings = runtime.settings.model_copy(update={"heartbeat_timeout_s": 1.5})
        job_id = make_job("fake:cooperative")
        cut_off = threading.Event()
        real_beat, real_poll = Watchdog._beat, Watchdog._poll

        def unreachable(real):
            def call(self):
                if cut_off.is_set():
                    raise ConnectionError("could not connect to server")
                return real(self)
            return call

        monkeypatch.setattr(Watchdog, "_beat", unreachable(real_beat))
        monkeypatch.setattr(Watchdog, "_poll", unreachable(real_poll))

        def cut_off_when_running() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _job(runtime, job_id).progress_step < 2:
                time.sleep(0.02)
            cut_off.set()

        threading.Thread(target=cut_off_when_running, daemon=True).start()
        result: list[str] = []
        runner = threading.Thread(target=lambda: result.append(run_job(runtime, job_id)), daemon=True)
        runner.start()
        runner.join(timeout=25)
        try:
            assert not runner.is_alive(), "the trainer kept running while its heartbeat failed"
        finally:
            runtime.shutdown_event.set()
            runner.join(timeout=20)
        assert result == ["running"]
        job = _job(runtime, job_id)
        assert job.status == "running" and job.worker_id == "test-host/gpu3"
        types = [e.type for e in _events(runtime, job_id)]
        assert "checkpoint" not in types and types.count("state") == 2  # queued, running: no transition


def test_bad_trainer_lines_are_dropped_and_the_rest_recorded(runtime, make_job):
    job_id = make_job("fake:messy:4")

    assert run_job(runtime, job_id) == "succeeded"

    events = _events(runtime, job_id)
    assert [e.type for e in events] == ["state", "state", "plan"] + ["step", "log"] + ["step"] * 3 + ["state"]
    assert events[4].data["message"] == "tokenizer said  here"
    assert _job(runtime, job_id).progress_step == 4


class TestHeartbeat:
    def test_a_running_job_beats_its_heartbeat(self, runtime, make_job):
        job_id = make_job("fake:cooperative")
        beats: list = []

        def sample() -> None:
            while len(beats) < 3:
                job = _job(runtime, job_id)
                if job.status == "running" and (not beats or job.heartbeat_at > beats[-1]):
                    beats.append(job.heartbeat_at)
                time.sleep(0.05)
            with runtime.sessionmaker.begin() as session:
                session.execute(update(Job).where(Job.job_id == job_id).values(cancel_requested=True))

        threading.Thread(target=sample, daemon=True).start()
        assert run_job(runtime, job_id) == "cancelled"
        assert len(beats) == 3


def test_job_json_is_what_the_trainer_reads(runtime, make_job, settings):
    job_id = make_job("fake:ok:1")
    run_job(runtime, job_id)
    raw = json.loads((settings.jobs_dir / job_id / "job.json").read_text())
    assert raw["model"]["name_or_path"] == "fake:ok:1"


def test_a_shutting_down_worker_does_not_claim_new_jobs(runtime, make_job):
    job_id = make_job("fake:ok:1")
    runtime.shutdown_event.set()
    assert run_job(runtime, job_id) == "deferred"
    assert _job(runtime, job_id).status == "queued" and _job(runtime, job_id).attempts == 0


def test_a_retry_resumes_from_the_newest_checkpoint_the_store_knows(runtime, make_job, settings):
    from core.jobs.models import Checkpoint

    job_id = make_job("fake:ok:1", attempts=1)
    checkpoints = settings.jobs_dir / job_id / "checkpoints"
    for step in (5, 10):
        (checkpoints / f"step-{step:06d}").mkdir(parents=True)
    with runtime.sessionmaker.begin() as session:
        session.add(Checkpoint(job_id=job_id, step=5, path=str(checkpoints / "step-000005"), bytes=1))

    assert run_job(runtime, job_id) == "succeeded"

    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000005"]
    assert (settings.jobs_dir / job_id / "unrecorded-checkpoints" / "step-000010-attempt2").is_dir()
    logs = [e.data["message"] for e in _events(runtime, job_id) if e.type == "log"]
    assert any("resuming from step 5 so the metrics have no gap" in m for m in logs)


def test_a_worker_fault_before_the_trainer_starts_fails_the_job_at_once(runtime, make_job, settings):
    job_id = make_job("fake:ok:1")
    (settings.jobs_dir / job_id).mkdir(parents=True)
    (settings.jobs_dir / job_id / "job.json").mkdir()  # job.json cannot be written

    assert run_job(runtime, job_id) == "failed"
    job = _job(runtime, job_id)
    assert job.error_code == "worker_error" and "IsADirectoryError" in job.error_message
