"""core.jobs.submit on a real SQLite store with recording ports: the order of the one submission
path (access, preflight, record and commit, then wake and notify) and what a refusal leaves."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.db import new_id, utcnow
from core.errors import Forbidden, InvalidInput
from core.files.models import File
from core.jobs import service
from core.jobs.models import Job
from core.jobs.spec import JobSpec
from core.jobs.submit import Origin, submit
from core.settings import Settings
from core.users import service as users
from core.users.service import Caller


class Ports:
    """``core.jobs.submit.Ports`` that records each call, and whether the job was committed then."""

    def __init__(self, sessions: sessionmaker, settings: Settings, *, refuse: bool = False) -> None:
        self.settings, self._sessions, self.refuse = settings, sessions, refuse
        self.calls: list[tuple[str, Any]] = []

    def sessions(self) -> Session:
        return self._sessions()

    def _stored(self) -> int:
        with self._sessions() as session:
            return len(service.list_jobs(session)[0])

    async def preflight(self, spec: JobSpec, owner: Caller) -> dict[str, Any]:
        self.calls.append(("preflight", self._stored()))
        if self.refuse:
            raise InvalidInput("training_file: no trainable token", param="training_file")
        return {"checked": True}

    def wake(self, job_id: str) -> None:
        self.calls.append(("wake", self._stored()))

    async def notify(self, job_id: str, seq: int) -> None:
        self.calls.append(("notify", seq))


def owner_with_file(sessions: sessionmaker, name: str) -> tuple[Caller, str]:
    with sessions() as session:
        user = users.create_user(session, name)
        caller = users.caller_of(session, user)
        file_id = new_id("file")
        session.add(File(file_id=file_id, filename="d.jsonl", purpose="train", bytes=1, sha256="0" * 64,
                         format="chat", num_records=1, path="/x", stats={}, owner_id=user.user_id,
                         project_id=caller.project_id, created_at=utcnow()))
        session.commit()
    return caller, file_id


def run(ports: Ports, spec: JobSpec, owner: Caller, origin: Origin = Origin()) -> tuple[str, bool]:
    return anyio.run(lambda: submit(ports, spec, owner, origin, view=lambda _session, job: job.job_id))


def test_a_job_is_committed_before_a_worker_is_woken_or_its_viewers_told(box) -> None:
    sessions, settings = box
    alice, file_id = owner_with_file(sessions, "alice")
    ports = Ports(sessions, settings)
    job_id, queued = run(ports, JobSpec(model="tiny", training_file=file_id), alice)
    assert queued
    assert ports.calls == [("preflight", 0), ("wake", 1), ("notify", 1)]
    with sessions() as session:
        job = session.get(Job, job_id)
        assert (job.status, job.owner_id, job.preflight) == ("queued", alice.user_id, {"checked": True})


def test_a_replay_of_an_idempotency_key_wakes_again_but_tells_nobody(box) -> None:
    sessions, settings = box
    alice, file_id = owner_with_file(sessions, "alice")
    spec, origin = JobSpec(model="tiny", training_file=file_id), Origin(idempotency_key="k1")
    first, _ = run(Ports(sessions, settings), spec, alice, origin)
    ports = Ports(sessions, settings)
    assert run(ports, spec, alice, origin) == (first, False)
    assert [name for name, _ in ports.calls] == ["preflight", "wake"]


def test_a_file_the_owner_may_not_use_is_refused_before_the_preflight(box) -> None:
    sessions, settings = box
    _, file_id = owner_with_file(sessions, "alice")
    bob, _ = owner_with_file(sessions, "bob")
    ports = Ports(sessions, settings)
    with pytest.raises(Forbidden):
        run(ports, JobSpec(model="tiny", training_file=file_id), bob)
    assert ports.calls == []


def test_a_refused_preflight_stores_nothing_and_wakes_nobody(box) -> None:
    sessions, settings = box
    alice, file_id = owner_with_file(sessions, "alice")
    ports = Ports(sessions, settings, refuse=True)
    with pytest.raises(InvalidInput):
        run(ports, JobSpec(model="tiny", training_file=file_id), alice)
    assert ports.calls == [("preflight", 0)]
