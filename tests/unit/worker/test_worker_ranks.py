"""A job of several GPUs on a host's pool: the worker launches real torchrun over the fake trainer
(one rank per reserved GPU, CUDA_VISIBLE_DEVICES = the reserved set), stores rank 0's events,
ends the job with the failed rank's reason, and leaves no process of the job behind, ranks in
their own sessions and their grandchildren included. The tagging and the kill by tag alone:
TestTaggedProcesses (no torchrun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select, update

from core.jobs.models import Checkpoint, Job, JobEvent, StepMetric
from core.workers.models import GpuSlot
from tests.fixtures.worker_runtime import make_queued_job, recording_runtime
from worker.launch import run_tag, torchrun_argv, torchrun_entry, trainer_argv
from worker.process import signal_tagged, tagged_pids, wait_untagged
from worker.runner import run_job
from worker.runtime import WorkerOptions


@pytest.fixture
def pool_runtime(settings):
    """A host holding GPUs 3, 5 and 7 (names only: the fake trainer needs none)."""
    rt = recording_runtime(settings.model_copy(update={"max_running_jobs_per_user": 0}), ("3", "5", "7"), "box")
    yield rt
    rt.engine.dispose()


def _job(runtime, job_id: str) -> Job:
    with runtime.sessionmaker() as session:
        return session.get(Job, job_id)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _held(runtime) -> list[str | None]:
    with runtime.sessionmaker() as session:
        return list(session.scalars(select(GpuSlot.job_id).order_by(GpuSlot.slot)))


class TestLaunch:
    def test_one_gpu_runs_the_trainer_and_several_run_torchrun(self, tmp_path):
        options = WorkerOptions(gpus=("0", "1"), trainer_argv=(sys.executable, "-m", "trainer"))
        job = tmp_path / "job.json"
        assert trainer_argv(options, job) == [sys.executable, "-m", "trainer", "run", str(job)]
        argv = torchrun_argv(options, job, ranks=2, rank_log_dir=tmp_path / "ranks")
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert argv[3:] == ["--standalone", "--nproc-per-node=2", f"--log-dir={tmp_path / 'ranks'}", "--tee=2",
                            "-m", "trainer", "run", str(job)]

    def test_a_trainer_command_that_is_no_python_runs_under_no_python(self):
        assert torchrun_entry(("/usr/bin/ftq-trainer", "--x")) == ["--no-python", "/usr/bin/ftq-trainer", "--x"]
        assert torchrun_entry(("python3", "t.py")) == ["t.py"]

    def test_tags_name_the_worker_job_and_attempt(self):
        assert run_tag("box/gpu0,1", "job-1", 2) == "box/gpu0,1|job-1|2"


class TestTaggedProcesses:
    def test_every_process_carrying_the_tag_is_found_and_killed_whatever_its_session(self):
        env = {**os.environ, "FTQ_JOB_PROCESS": "w|job-x|1"}
        code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); time.sleep(60)"
        parent = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            deadline = time.monotonic() + 10
            while len(tagged_pids("w|job-x|1")) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            tagged = tagged_pids("w|job-x|1")
            assert parent.pid in tagged and len(tagged) == 2 and other.pid not in tagged
            assert set(tagged_pids("w|")) == set(tagged)  # the worker's prefix finds its runs
            assert signal_tagged("w|job-x|1", signal.SIGKILL) == 2
            parent.wait(timeout=10)
            assert wait_untagged("w|job-x|1", timeout_s=10) == []
            assert other.poll() is None
        finally:
            for proc in (parent, other):
                proc.kill()
                proc.wait()


@pytest.mark.slow  # real torchrun: a few seconds to import torch and rendezvous
class TestTorchrun:
    def test_a_two_gpu_job_runs_two_ranks_on_its_reserved_gpus(self, pool_runtime, settings):
        job_id = _make(pool_runtime, "fake:ok:3", gpus=2)

        assert run_job(pool_runtime, job_id) == "succeeded"

        out = settings.jobs_dir / job_id
        assert (out / "cuda0.txt").read_text() == "3,5" and (out / "cuda1.txt").read_text() == "3,5"
        with pool_runtime.sessionmaker() as session:
            steps = session.scalars(select(StepMetric.step).where(StepMetric.job_id == job_id)).all()
        assert sorted(steps) == [1, 2, 3]  # rank 0's events only
        assert _held(pool_runtime) == [None, None, None]
        assert tagged_pids(run_tag("box", job_id, 1)) == []

    def test_a_killed_rank_fails_the_job_with_its_reason_and_leaves_no_process(self, pool_runtime, settings):
        job_id = _make(pool_runtime, "fake:rankkill", gpus=2)

        assert run_job(pool_runtime, job_id) == "queued"  # an unexplained kill: retried (issue 10)
        assert run_job(pool_runtime, job_id) == "failed"

        job = _job(pool_runtime, job_id)
        assert job.error_code == "killed", job.error_message  # retried once (max_attempts=2), then failed
        assert job.error_message.startswith("rank 1 of 2 was killed by SIGKILL from outside ftq")
        assert "rank 1: about to be killed" in job.error_message
        out = settings.jobs_dir / job_id
        pids = [int((out / name).read_text()) for name in ("rank0.pid", "rank1.pid", "rank0-grandchild.pid",
                                                           "rank1-grandchild.pid")]
        assert not [pid for pid in pids if _alive(pid)], "a process of the job survived it"
        assert tagged_pids(run_tag("box", job_id, 1)) == []
        assert _held(pool_runtime) == [None, None, None]

    def test_a_cancel_stops_every_rank_and_rank_0_checkpoints(self, pool_runtime, settings):
        job_id = _make(pool_runtime, "fake:cooperative", gpus=3)

        def cancel_soon() -> None:
            deadline = time.monotonic() + 60
            while _job(pool_runtime, job_id).progress_step < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            with pool_runtime.sessionmaker.begin() as session:
                session.execute(update(Job).where(Job.job_id == job_id).values(cancel_requested=True))

        threading.Thread(target=cancel_soon, daemon=True).start()
        assert run_job(pool_runtime, job_id) == "cancelled"
        with pool_runtime.sessionmaker() as session:
            final = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq.desc())).first()
            checkpoints = session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)).all()
        assert final.data["status"] == "cancelled" and final.data["message"].startswith("stopped at step")
        assert checkpoints  # rank 0 checkpointed on the way out, not killed
        assert tagged_pids(run_tag("box", job_id, 1)) == [] and _held(pool_runtime) == [None, None, None]


def _make(runtime, model: str, **values) -> str:
    """A queued job (as conftest's make_job, for this runtime)."""
    return make_queued_job(runtime, model, **values)


class TestLeftovers:
    def test_a_restarted_worker_kills_the_processes_its_earlier_run_left_for_jobs_of_its_store(self, runtime, make_job):
        from worker.app import kill_leftovers

        job_id = make_job("fake:ok")
        code = "import time; time.sleep(60)"
        ours = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                env={**os.environ, "FTQ_JOB_PROCESS": run_tag(runtime.worker_id, job_id, 1)})
        other_store = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                       env={**os.environ, "FTQ_JOB_PROCESS": run_tag(runtime.worker_id, "job-elsewhere", 1)})
        try:
            deadline = time.monotonic() + 10
            while len(tagged_pids(f"{runtime.worker_id}|")) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert kill_leftovers(runtime) == [ours.pid]
            assert ours.wait(timeout=10) == -signal.SIGKILL
            assert other_store.poll() is None, "another install's process with the same worker id was killed"
        finally:
            for proc in (ours, other_store):
                proc.kill()
                proc.wait()
