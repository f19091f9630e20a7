"""A SQLite store with the schema, a Runtime over it, and jobs that run the fake trainer."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, update

from core.db import make_engine, make_sessionmaker, new_id, utcnow
from core.files.models import File
from core.jobs.models import Job
from core.jobs.service import append_events, state_event
from core.jobs.states import JobStatus
from core.models import metadata
from core.settings import Settings
from trainer.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from worker.runtime import Runtime, WorkerOptions

FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")


class FakeBuilder:
    """Builds the fake trainer's config: ``model.name_or_path`` names its behaviour."""

    def __call__(self, session: Any, job: Job, *, settings: Settings, output_dir: str) -> TrainConfig:
        return TrainConfig(
            model=ModelConfig(name_or_path=job.model),
            data=DataConfig(train_path="/dev/null", max_seq_len=8, batch_tokens=8),
            optim=OptimConfig(max_steps=3),
            output_dir=output_dir,
            job_id=job.job_id,
        )


class Recorded:
    """Stands in for the broker: the job ids sent (and to which host), and the seqs published."""

    def __init__(self) -> None:
        self.enqueued: list[str] = []
        self.hosts: list[str | None] = []
        self.published: list[tuple[str, int]] = []

    def enqueue(self, job_id: str, host: str | None = None) -> None:
        self.enqueued.append(job_id)
        self.hosts.append(host)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        model_root=tmp_path / "models",
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=5.0,
        cancel_grace_s=1.0,
        event_flush_interval_s=0.05,
        max_attempts=2,
        max_running_jobs_per_user=1,
    ).resolved()


def recording_runtime(settings: Settings, gpus: tuple[str, ...], name: str) -> Runtime:
    """A worker ``Runtime`` over a fresh store that runs the fake trainer and records what it
    enqueues and publishes (``rt.recorded``); the caller disposes ``rt.engine``."""
    settings.data_dir.mkdir(parents=True)
    engine = make_engine(settings.database_url or "")
    metadata.create_all(engine)
    recorded = Recorded()
    rt = Runtime(
        settings,
        WorkerOptions(gpus=gpus, name=name, trainer_argv=(sys.executable, str(FAKE_TRAINER))),
        engine=engine,
        sessionmaker=make_sessionmaker(engine),
        config_builder=FakeBuilder(),
    )
    rt.enqueue = recorded.enqueue  # type: ignore[method-assign]
    rt.publish = lambda job_id, seq: recorded.published.append((job_id, seq))  # type: ignore[method-assign]
    rt.recorded = recorded  # type: ignore[attr-defined]
    return rt


@pytest.fixture
def runtime(settings: Settings) -> Iterator[Runtime]:
    rt = recording_runtime(settings, ("3",), "test-host/gpu3")
    yield rt
    rt.engine.dispose()


@pytest.fixture
def make_job(runtime: Runtime):
    """``make_job("fake:ok:5")`` inserts a queued job whose trainer behaves as named."""

    def _make(model: str, *, updated_at: dt.datetime | None = None, **values: Any) -> str:
        job_id = new_id("job")
        with runtime.sessionmaker.begin() as session:
            file_id = new_id("file")
            session.add(File(file_id=file_id, filename="t.jsonl", purpose="train", bytes=1, sha256="0" * 64,
                             format="text", num_records=1, path="/dev/null"))
            session.flush()
            values = {"status": JobStatus.queued.value, "created_at": utcnow(), "updated_at": utcnow(), **values}
            session.add(Job(job_id=job_id, model=model, method="lora", spec={}, training_file_id=file_id, **values))
            session.flush()
            append_events(session, job_id, [state_event(JobStatus.queued)])
            if updated_at is not None:  # appending events bumps it (onupdate)
                session.execute(update(Job).where(Job.job_id == job_id).values(updated_at=updated_at))
        return job_id

    return _make


@pytest.fixture
def commits(runtime: Runtime) -> list[int]:
    """Counts the store's committed transactions (one entry per commit)."""
    seen: list[int] = []
    event.listen(runtime.engine, "commit", lambda conn: seen.append(1))
    return seen
