"""The projects migration on PostgreSQL and SQLite, with rows present: upgrade puts every user,
file, job and export into the ``default`` project; downgrade, then upgrade again, loses nothing
(not an API key, a job event or a checkpoint: SQLite copies the user and job tables, whose
``ON DELETE CASCADE`` would take them if foreign keys were on during the copy)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, insert, select, text

from core import migrate
from core.db import new_id, utcnow
from core.exports.models import Export
from core.files.models import File
from core.jobs.models import Checkpoint, Job, JobEvent, StepMetric
from core.users.models import ApiKey, User

pytestmark = pytest.mark.integration

BEFORE_PROJECTS = "3c7a9e51f2d0"
COUNTED = ("user", "api_key", "file", "job", "job_event", "step_metric", "checkpoint", "export")


def insert_work(store) -> dict[str, str]:
    """Two users with keys, a file, a job with events, a metric, a checkpoint and an export, written
    with Core (at this revision the tables lack the project columns the models now have)."""
    now = utcnow()
    ids = {"alice": new_id("user"), "bob": new_id("user"), "file": new_id("file"), "job": new_id("job"),
           "export": new_id("exp")}
    with store.sessions.begin() as session:
        for name in ("alice", "bob"):
            session.execute(insert(User.__table__).values(user_id=ids[name], name=name, is_admin=name == "bob",
                                                          created_at=now))
            session.execute(insert(ApiKey.__table__).values(api_key_id=new_id("key"), user_id=ids[name],
                                                            prefix=ids[name][-8:], key_hash="0" * 64, created_at=now))
        session.execute(insert(File.__table__).values(
            file_id=ids["file"], owner_id=ids["alice"], filename="d.jsonl", purpose="train", bytes=1, sha256="0" * 64,
            format="chat", num_records=1, path="/dev/null", stats={}, created_at=now))
        session.execute(insert(Job.__table__).values(
            job_id=ids["job"], owner_id=ids["alice"], model="tiny", method="lora", spec={"model": "tiny"},
            training_file_id=ids["file"], status="succeeded", priority="high", gpus=2, nodes=1, progress_step=3,
            cancel_requested=False, attempts=1, last_event_seq=2, created_at=now, updated_at=now))
        session.execute(insert(JobEvent.__table__), [
            {"job_id": ids["job"], "seq": seq, "type": "log", "data": {"line": seq}, "created_at": now} for seq in (1, 2)])
        session.execute(insert(StepMetric.__table__).values(job_id=ids["job"], step=1, loss=2.5, time=now))
        session.execute(insert(Checkpoint.__table__).values(job_id=ids["job"], step=1, path="/x", bytes=9, final=True,
                                                            created_at=now))
        session.execute(insert(Export.__table__).values(
            export_id=ids["export"], job_id=ids["job"], format="merged", status="succeeded", progress=1.0,
            owner_id=ids["alice"], created_at=now))
    return ids


def counts(store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in COUNTED}


def assert_all_in_default(store, ids: dict[str, str]) -> None:
    with store.engine.connect() as conn:
        [(project_id, name)] = conn.execute(text("SELECT project_id, name FROM project")).all()
        assert name == "default"
        members = conn.execute(text("SELECT user_id, role FROM project_member ORDER BY user_id")).all()
        assert sorted(members) == sorted([(ids["alice"], "member"), (ids["bob"], "member")])
        assert set(conn.execute(text('SELECT default_project_id FROM "user"')).scalars()) == {project_id}
        for table in ("file", "job", "export"):
            assert set(conn.execute(text(f'SELECT project_id FROM "{table}"')).scalars()) == {project_id}, table


def test_projects_migration_round_trip_keeps_every_row(store) -> None:
    migrate.downgrade(store.url, BEFORE_PROJECTS)
    try:
        ids = insert_work(store)
        before = counts(store)
        assert before == {"user": 2, "api_key": 2, "file": 1, "job": 1, "job_event": 2, "step_metric": 1,
                          "checkpoint": 1, "export": 1}
    finally:
        migrate.upgrade(store.url)
    assert counts(store) == before
    assert_all_in_default(store, ids)

    migrate.downgrade(store.url, BEFORE_PROJECTS)
    try:
        assert counts(store) == before
        with store.engine.connect() as conn:
            job = conn.execute(text("SELECT owner_id, priority, gpus, status FROM job")).one()
            assert tuple(job) == (ids["alice"], "high", 2, "succeeded")
            assert conn.execute(text("SELECT count(*) FROM job_event WHERE job_id = :j"), {"j": ids["job"]}).scalar_one() == 2
    finally:
        migrate.upgrade(store.url)
    assert counts(store) == before
    assert_all_in_default(store, ids)
    migrate.check(store.url)
    with store.sessions() as session:
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 2
