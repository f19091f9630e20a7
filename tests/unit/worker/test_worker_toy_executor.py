"""An executor added from outside the worker package trains a tiny job through the real runner.

``ToyExecutor`` starts the real trainer under a wrapper process of its own (``toy_wrapper.py``),
reads its events from the wrapper's stdout, stops it by SIGTERM to the wrapper (which forwards
it) and kills the wrapper's process group. It is registered under ``toy`` and chosen by
``WorkerOptions.executor``; the claim, the watchdog, the event recording and the outcome are
the worker's own code (``worker.runner.run_job``).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from core.db import make_engine, make_sessionmaker
from core.jobs.models import Checkpoint, Job, StepMetric
from core.models import metadata
from core.settings import Settings
from trainer.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, TrainConfig
from trainer.events import parse_line
from worker import executors
from worker.claim import Claim
from worker.executors import Executor, OnEvent, Signal
from worker.launch import trainer_env
from worker.process import TrainerExit
from worker.runner import run_job
from worker.runtime import Runtime, WorkerOptions

pytestmark = pytest.mark.slow  # real training runs of the tiny model

WRAPPER = Path(__file__).with_name("toy_wrapper.py")


class ToyExecutor(Executor):
    """The trainer under ``toy_wrapper.py`` in a session of its own; every call is logged."""

    built: list[ToyExecutor] = []

    def __init__(self, runtime: Runtime, claim: Claim) -> None:
        self.runtime = runtime
        self.claim = claim
        self.calls: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.readers: list[threading.Thread] = []
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        ToyExecutor.built.append(self)

    def start(self, job_json: Path, on_event: OnEvent) -> None:
        self.calls.append("start")
        argv = [sys.executable, str(WRAPPER), str(self.claim.output_dir / "wrapper.log"),
                *self.runtime.options.trainer_argv, "run", str(job_json)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.claim.output_dir,
                                     env=trainer_env(self.runtime, self.claim.devices), start_new_session=True)
        self.readers = [threading.Thread(target=self._events, args=(on_event,), daemon=True),
                        threading.Thread(target=self._stderr, daemon=True)]
        for reader in self.readers:
            reader.start()

    def _events(self, on_event: OnEvent) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with self.proc.stdout as stream:
            for line in stream:
                if (event := parse_line(line)) is not None:
                    on_event(event)

    def _stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with self.proc.stderr as stream:
            for line in stream:
                self.stderr_tail.append(line.decode(errors="replace").rstrip())

    def watch(self) -> bool:
        if not self.calls or self.calls[-1] != "watch":
            self.calls.append("watch")
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signal_: Signal) -> bool:
        self.calls.append(f"signal {signal_.value}")
        if self.proc is None or self.proc.poll() is not None:
            return False
        if signal_ is Signal.stop:
            self.proc.send_signal(signal.SIGTERM)  # to the wrapper alone: it forwards it
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return True

    def collect(self) -> TrainerExit:
        self.calls.append("collect")
        if self.proc is None:
            return TrainerExit(returncode=-1, stderr_tail=())
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        returncode = self.proc.wait()
        for reader in self.readers:
            reader.join(timeout=10)
        return TrainerExit(returncode=returncode, stderr_tail=tuple(self.stderr_tail))


class TinyBuilder:
    """A CPU LoRA run of the tiny model; the job's ``model`` names its steps (``tiny:<steps>``)."""

    def __init__(self, model_dir: Path, train: Path) -> None:
        self.model_dir = model_dir
        self.train = train

    def __call__(self, session: Any, job: Job, *, settings: Settings, output_dir: str) -> TrainConfig:
        return TrainConfig(
            model=ModelConfig(str(self.model_dir)),
            data=DataConfig(str(self.train), max_seq_len=64, batch_tokens=256),
            optim=OptimConfig(max_steps=int(job.model.split(":")[1]), warmup_steps=1),
            lora=LoraConfig(r=8, alpha=16),
            output_dir=output_dir,
            job_id=job.job_id,
            gradient_checkpointing="off",
            device="cpu",
        )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyBuilder:
    from trainer.model.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("toy-executor")
    records = [{"messages": [{"role": "user", "content": f"What is {i % 5} plus one?"},
                             {"role": "assistant", "content": f"The answer is {i % 5 + 1}."}]} for i in range(20)]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return TinyBuilder(make_tiny_model(root / "model", "llama", seed=0), train)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The worker tests' settings with a grace long enough for a real trainer's checkpoint."""
    return Settings(data_dir=tmp_path / "data", model_root=tmp_path / "models", heartbeat_interval_s=0.2,
                    heartbeat_timeout_s=10.0, cancel_grace_s=60.0, event_flush_interval_s=0.05,
                    max_attempts=1).resolved()


@pytest.fixture
def runtime(settings: Settings, tiny: TinyBuilder) -> Iterator[Runtime]:
    """A worker host whose every job runs on the ``toy`` executor (registered here, from outside)."""
    executors.register("toy", ToyExecutor)
    ToyExecutor.built.clear()
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.database_url or "")
    metadata.create_all(engine)
    rt = Runtime(settings, WorkerOptions(name="toy-host/cpu", executor="toy"), engine=engine,
                 sessionmaker=make_sessionmaker(engine), config_builder=tiny)
    yield rt
    engine.dispose()
    executors.unregister("toy")


def _job(runtime: Runtime, job_id: str) -> Job:
    with runtime.sessionmaker() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


class TestToyExecutor:
    def test_it_trains_a_tiny_job_end_to_end_through_the_runner(self, runtime, make_job, settings):
        job_id = make_job("tiny:3")

        assert run_job(runtime, job_id) == "succeeded"

        (toy,) = ToyExecutor.built
        assert toy.claim.executor == "toy" and toy.claim.job_id == job_id
        assert toy.calls == ["start", "watch", "collect"]
        job = _job(runtime, job_id)
        assert (job.progress_step, job.total_steps, job.error_code) == (3, 3, None)
        with runtime.sessionmaker() as session:
            losses = session.scalars(select(StepMetric.loss).where(StepMetric.job_id == job_id)).all()
            assert session.get(Checkpoint, (job_id, 3)).final
        assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)
        out = settings.jobs_dir / job_id
        assert (out / "adapter").is_dir()
        log = (out / "wrapper.log").read_text().splitlines()
        assert log[0].startswith("started ") and log[-1] == "exit 0"

    def test_a_cancel_reaches_the_trainer_through_the_toy_executor_and_it_checkpoints(
        self, runtime, make_job, settings
    ):
        job_id = make_job("tiny:100000")

        def cancel_after_a_step() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and _job(runtime, job_id).progress_step < 1:
                time.sleep(0.05)
            with runtime.sessionmaker.begin() as session:
                session.execute(update(Job).where(Job.job_id == job_id).values(cancel_requested=True))

        threading.Thread(target=cancel_after_a_step, daemon=True).start()
        assert run_job(runtime, job_id) == "cancelled"

        (toy,) = ToyExecutor.built
        assert toy.calls == ["start", "watch", "signal stop", "watch", "collect"]
        job = _job(runtime, job_id)
        assert job.error_code is None and 1 <= job.progress_step < 100000
        with runtime.sessionmaker() as session:
            assert session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)).all()
        log = (settings.jobs_dir / job_id / "wrapper.log").read_text().splitlines()
        assert "forwarded SIGTERM" in log and log[-1] == "exit 0"
