"""A SQLite store with the schema, a Runtime over it (tests/fixtures/worker_runtime.py), and jobs that
run the fake trainer."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, update

from core.db import new_id, utcnow
from core.files.models import File
from core.jobs.models import Job
from core.jobs.service import append_events, state_event
from core.jobs.states import JobStatus
from core.settings import Settings
from tests.fixtures.worker_runtime import FAKE_EXPORT, recording_runtime
from worker.runtime import Runtime


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


@pytest.fixture
def runtime(settings: Settings) -> Iterator[Runtime]:
    rt = recording_runtime(settings, ("3",), "test-host/gpu3")
    yield rt
    rt.engine.dispose()


@pytest.fixture
def export_runtime(runtime: Runtime) -> Runtime:
    """``runtime`` whose trainer process is the fake export (tests/unit/worker/fake_export.py)."""
    runtime.options = type(runtime.options)(gpus=("3",), name=runtime.worker_id, trainer_argv=(sys.executable, str(FAKE_EXPORT)))
    return runtime


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
