"""The Slurm executor's lifecycle against a scripted stand-in for Slurm's commands (the real
cluster: tests/integration/e2e/test_slurm_e2e.py): what it writes and submits, the events it
tails from the shared directory, the states and reasons it logs, how it stops, what it collects."""

from __future__ import annotations

import json
from pathlib import Path

from core.jobs.states import JobStatus
from worker.claim import Claim
from worker.executors.base import Signal
from worker.executors.slurm import SlurmExecutor
from worker.outcome import Outcome
from worker.slurm.commands import JobState, SlurmCli
from worker.slurm.config import BridgeConfig


class ScriptedSlurm(SlurmCli):
    """Answers ``state`` from a list (the last one repeats) and records submissions and cancels."""

    def __init__(self, states: list[JobState]) -> None:
        super().__init__()
        self.states = states
        self.submitted: list[tuple[Path, dict[str, str]]] = []
        self.cancelled: list[tuple[str, str | None]] = []

    def submit(self, script: Path, env: dict[str, str] | None = None) -> str:
        self.submitted.append((script, env or {}))
        return "77"

    def state(self, slurm_job_id: str) -> JobState:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def cancel(self, slurm_job_id: str, *, signal: str | None = None) -> bool:
        self.cancelled.append((slurm_job_id, signal))
        return True


def executor(runtime, make_job, tmp_path: Path, states: list[JobState]) -> tuple[SlurmExecutor, ScriptedSlurm, list]:
    job_id = make_job("fake:ok:3", nodes=1, gpus=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "job.json").write_text(json.dumps({"job_id": job_id, "output_dir": str(out)}))
    cli = ScriptedSlurm(states)
    config = BridgeConfig(partition="gpu", shared_dir=tmp_path, poll_s=0.0)
    bound = SlurmExecutor.bound(config, cli)
    events: list = []
    ex = bound(runtime, Claim(job_id, 1, out, executor="slurm"))
    ex.start(out / "job.json", events.append)
    return ex, cli, events


def test_a_job_is_submitted_from_the_shared_directory_and_its_events_tailed(runtime, make_job, tmp_path):
    states = [JobState("PENDING", "Priority"), JobState("PENDING", "Priority"), JobState("PENDING", "Resources"),
              JobState("RUNNING"), JobState("COMPLETED")]
    ex, cli, events = executor(runtime, make_job, tmp_path, states)
    (script, env), = cli.submitted
    assert script == ex.dir / "job.sbatch" and "FTQ_DATABASE_URL" not in env and env["PYTHONUNBUFFERED"] == "1"
    assert json.loads((ex.dir / "job.json").read_text())["job_id"] == ex.claim.job_id
    assert f"trainer run {ex.dir / 'job.json'}" in script.read_text()
    stream = (ex.dir / "events.jsonl").open("w")
    stream.write('{"type": "step", "step": 1}\nnot an event\n{"type": "st')
    stream.flush()
    assert ex.watch() and ex.watch() and ex.watch()
    stream.write('ep", "step": 2}\n{"type": "done", "status": "succeeded"}\n')
    stream.close()
    assert ex.watch() is True and ex.watch() is False
    assert [e["type"] for e in events if e["type"] != "log"] == ["step", "step", "done"]
    logs = [e["message"] for e in events if e["type"] == "log"]
    assert logs == [f"submitted to Slurm as job 77 (partition gpu, 1 node x 1 cpu slot; files in {ex.dir})",
                    "Slurm job 77: PENDING (Priority)", "Slurm job 77: PENDING (Resources)", "Slurm job 77: RUNNING",
                    "Slurm job 77: COMPLETED"]
    assert ex.collect().returncode == 0 and cli.cancelled == []


def test_stop_cancels_a_pending_job_outright_and_terms_a_running_one(runtime, make_job, tmp_path):
    ex, cli, _ = executor(runtime, make_job, tmp_path, [JobState("PENDING", "Resources"), JobState("RUNNING")])
    assert ex.watch()
    assert ex.signal(Signal.stop) and cli.cancelled == [("77", None)]
    (ex.dir / "events.jsonl").write_text('{"type": "log", "message": "loading"}\n')
    assert ex.watch()
    assert ex.signal(Signal.stop) and cli.cancelled[-1] == ("77", "TERM")
    assert ex.signal(Signal.kill) and cli.cancelled[-1] == ("77", None)


def test_collect_ends_what_still_runs_and_settle_retries_a_failed_node(runtime, make_job, tmp_path):
    ex, cli, _ = executor(runtime, make_job, tmp_path, [JobState("RUNNING"), JobState("NODE_FAIL", "NodeDown", 0, 9)])
    assert ex.watch()
    (ex.dir / "stderr.log").write_text("srun: error: n2: task 1: Killed\n")
    exit_ = ex.collect()
    assert cli.cancelled == [("77", None)]
    assert exit_.returncode == -9 and exit_.stderr_tail == ("srun: error: n2: task 1: Killed",)
    settled = ex.settle(Outcome(JobStatus.failed, "killed", "killed"), max_attempts=2)
    assert (settled.status, settled.error_code, settled.retry) == (JobStatus.queued, "node_fail", True)


def test_a_job_slurm_would_never_start_is_cancelled_and_fails_naming_the_reason(runtime, make_job, tmp_path):
    ex, cli, events = executor(runtime, make_job, tmp_path, [JobState("PENDING", "QOSMaxGRESPerJob"),
                                                              JobState("CANCELLED")])
    assert ex.watch() and cli.cancelled == [("77", None)]
    assert ex.watch() is False
    exit_ = ex.collect()
    assert exit_.returncode == -1
    settled = ex.settle(Outcome(JobStatus.failed, "killed", "the trainer was killed by SIGHUP"), max_attempts=3)
    assert (settled.status, settled.error_code) == (JobStatus.failed, "slurm_refused")
    assert "pending reason QOSMaxGRESPerJob" in (settled.message or "")


def test_a_job_cancelled_by_someone_else_before_it_ran_says_so(runtime, make_job, tmp_path):
    ex, cli, _ = executor(runtime, make_job, tmp_path, [JobState("PENDING", "Priority"), JobState("CANCELLED")])
    assert ex.watch() and ex.watch() is False
    ex.collect()
    settled = ex.settle(Outcome(JobStatus.failed, "killed", "x"), max_attempts=3)
    assert settled.error_code == "slurm_not_started" and "ended CANCELLED" in (settled.message or "")


def test_a_stop_before_the_trainers_first_event_is_sent_once_it_came(runtime, make_job, tmp_path):
    """Slurm drops a TERM sent before the job's srun step exists, and a trainer still importing
    dies of it without a checkpoint: the TERM waits for the trainer's first event (the real
    cluster: test_a_pause_right_after_the_slurm_job_started_reaches_the_trainer)."""
    ex, cli, events = executor(runtime, make_job, tmp_path, [JobState("RUNNING")])
    assert ex.watch()
    assert ex.signal(Signal.stop) and ex.signal(Signal.stop) and cli.cancelled == []
    assert ex.watch() and ex.watch() and cli.cancelled == []
    waits = [e["message"] for e in events if "its TERM waits for the trainer's first event" in e.get("message", "")]
    assert len(waits) == 1, waits
    (ex.dir / "events.jsonl").write_text('{"type": "log", "message": "loading"}\n')
    assert ex.watch() and ex.watch() and cli.cancelled == [("77", "TERM")]
    (tmp_path / "kill").mkdir()
    other, cli2, _ = executor(runtime, make_job, tmp_path / "kill", [JobState("RUNNING")])
    assert other.watch() and other.signal(Signal.stop) and other.signal(Signal.kill) and cli2.cancelled == [("77", None)]
    (other.dir / "events.jsonl").write_text('{"type": "log", "message": "loading"}\n')
    assert other.watch() and cli2.cancelled == [("77", None)], "a kill drops the stop that waited"
