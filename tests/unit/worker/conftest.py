"""A SQLite store with the schema, a Runtime over it (tests/fixtures/worker_runtime.py), and jobs that
run the fake trainer."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from core.settings import Settings
from tests.fixtures.worker_runtime import FAKE_EXPORT, make_queued_job, recording_runtime
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
        return make_queued_job(runtime, model, updated_at=updated_at, **values)

    return _make


@pytest.fixture
def commits(runtime: Runtime) -> list[int]:
    """Counts the store's committed transactions (one entry per commit)."""
    seen: list[int] = []
    event.listen(runtime.engine, "commit", lambda conn: seen.append(1))
    return seen
