"""The project tracking_servers migration on PostgreSQL and SQLite, with rows present: upgrade gives
every existing project NULL (all the box's servers, as before); downgrade keeps every project,
membership, default project and piece of work (SQLite copies ``project``, which memberships cascade
from and users, keys and work point at), and upgrading again reads back as before."""

from __future__ import annotations

import pytest
from sqlalchemy import insert, text

from core import migrate
from core.db import new_id, utcnow
from core.files.models import File
from core.jobs.models import Job
from core.projects.models import Project, ProjectMember
from core.users.models import ApiKey, User

pytestmark = pytest.mark.integration

BEFORE = "5d2e8b7c41a9"
COUNTED = ("project", "project_member", "user", "api_key", "file", "job")


def insert_rows(store) -> dict[str, str]:
    """A project with a member (their default), a key of it, a file and a job in it, written with
    Core (at this revision ``project`` lacks the column the model now has)."""
    now = utcnow()
    ids = {"project": new_id("proj"), "user": new_id("user"), "file": new_id("file"), "job": new_id("job")}
    with store.sessions.begin() as session:
        session.execute(insert(Project.__table__).values(project_id=ids["project"], name="vision", max_gpus=2,
                                                         created_at=now))
        session.execute(insert(User.__table__).values(user_id=ids["user"], name="carol", is_admin=False,
                                                      default_project_id=ids["project"], created_at=now))
        session.execute(insert(ProjectMember.__table__).values(project_id=ids["project"], user_id=ids["user"],
                                                               role="admin", created_at=now))
        session.execute(insert(ApiKey.__table__).values(api_key_id=new_id("key"), user_id=ids["user"],
                                                        prefix=ids["user"][-8:], key_hash="1" * 64,
                                                        project_id=ids["project"], created_at=now))
        session.execute(insert(File.__table__).values(
            file_id=ids["file"], owner_id=ids["user"], project_id=ids["project"], filename="d.jsonl", purpose="train",
            bytes=1, sha256="0" * 64, format="chat", num_records=1, path="/dev/null", stats={}, created_at=now))
        session.execute(insert(Job.__table__).values(
            job_id=ids["job"], owner_id=ids["user"], project_id=ids["project"], model="tiny", method="lora",
            spec={"model": "tiny"}, training_file_id=ids["file"], status="queued", priority="normal", gpus=1, nodes=1,
            progress_step=0, cancel_requested=False, attempts=0, last_event_seq=0, created_at=now, updated_at=now))
    return ids


def counts(store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in COUNTED}


def links(store, ids: dict[str, str]) -> tuple:
    """What points at the project: the member's role, the user's and key's default, the work's project."""
    with store.engine.connect() as conn:
        return (conn.execute(text("SELECT role FROM project_member WHERE user_id = :u"), {"u": ids["user"]}).scalar_one(),
                conn.execute(text('SELECT default_project_id FROM "user" WHERE user_id = :u'), {"u": ids["user"]}).scalar_one(),
                conn.execute(text("SELECT project_id FROM api_key WHERE user_id = :u"), {"u": ids["user"]}).scalar_one(),
                conn.execute(text("SELECT project_id FROM file")).scalar_one(),
                conn.execute(text("SELECT project_id FROM job")).scalar_one())


def servers_of(store, project_id: str) -> list[str] | None:
    with store.sessions() as session:
        return session.get(Project, project_id).tracking_servers


def test_tracking_servers_migration_round_trip_keeps_every_row(store) -> None:
    migrate.downgrade(store.url, BEFORE)
    try:
        ids = insert_rows(store)
        before, linked = counts(store), links(store, ids)
        assert linked == ("admin", *[ids["project"]] * 4)
    finally:
        migrate.upgrade(store.url)
    assert counts(store) == before and links(store, ids) == linked
    assert servers_of(store, ids["project"]) is None  # an existing project: all the box's, as before
    with store.sessions.begin() as session:
        session.get(Project, ids["project"]).tracking_servers = ["team", "wandb"]
    assert servers_of(store, ids["project"]) == ["team", "wandb"]

    migrate.downgrade(store.url, BEFORE)
    try:
        assert counts(store) == before and links(store, ids) == linked
        with store.engine.connect() as conn:
            columns = conn.execute(text("SELECT * FROM project")).keys()
            assert "tracking_servers" not in columns
            assert conn.execute(text("SELECT name, max_gpus FROM project WHERE project_id = :p"),
                                {"p": ids["project"]}).one() == ("vision", 2)
    finally:
        migrate.upgrade(store.url)
    assert counts(store) == before and links(store, ids) == linked
    assert servers_of(store, ids["project"]) is None
    migrate.check(store.url)
