"""core.jobs.service.transition on a real SQLite store (no server): compare-and-set semantics."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker

from core import migrate
from core.db import make_engine, make_sessionmaker, new_id, utcnow
from core.files.models import File
from core.jobs import service
from core.jobs.models import Job
from core.jobs.states import JobStatus


@pytest.fixture
def sessions(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'ftq.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    yield make_sessionmaker(engine)
    engine.dispose()


def new_job(sessions: sessionmaker) -> str:
    with sessions() as session:
        file_id, job_id = new_id("file"), new_id("job")
        session.add(File(file_id=file_id, filename="d", purpose="train", bytes=1, sha256="0" * 64,
                         format="text", num_records=1, path="/x", stats={}, created_at=utcnow()))
        session.flush()
        session.add(Job(job_id=job_id, model="m", method="lora", spec={}, training_file_id=file_id,
                        created_at=utcnow(), updated_at=utcnow()))
        session.commit()
    return job_id


def test_two_sessions_race_for_the_claim_and_exactly_one_wins(sessions: sessionmaker) -> None:
    job_id = new_job(sessions)
    barrier = threading.Barrier(2)
    wins: list[bool] = []

    def claim() -> None:
        with sessions() as session:
            barrier.wait()
            wins.append(service.transition(session, job_id, JobStatus.running, only_from=[JobStatus.queued]))
            session.commit()

    threads = [threading.Thread(target=claim) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(wins) == [False, True]


def test_transition_sets_timestamps_and_extra_columns(sessions: sessionmaker) -> None:
    job_id = new_job(sessions)
    with sessions() as session:
        assert service.transition(session, job_id, JobStatus.running, worker_id="w1", attempts=1)
        assert service.transition(session, job_id, JobStatus.succeeded)
        session.commit()
        job = session.get(Job, job_id)
        assert (job.status, job.worker_id, job.attempts) == ("succeeded", "w1", 1)
        assert job.started_at <= job.finished_at


def test_only_from_narrows_the_sources(sessions: sessionmaker) -> None:
    job_id = new_job(sessions)
    with sessions() as session:
        assert not service.transition(session, job_id, JobStatus.failed, only_from=[JobStatus.running])
        assert service.transition(session, job_id, JobStatus.failed, only_from=[JobStatus.queued])


def test_illegal_transition_does_nothing(sessions: sessionmaker) -> None:
    job_id = new_job(sessions)
    with sessions() as session:
        assert not service.transition(session, job_id, JobStatus.succeeded)  # queued -> succeeded
        assert session.get(Job, job_id).status == "queued"
