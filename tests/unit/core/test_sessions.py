"""Chat sessions in the store (``core.sessions``) on a SQLite store: a session is a queued job of kind
``session`` that a later request for the same model finds (in its project only), its config names
the base and each adapter, and the relay carries a request to the worker's side and its replies back
(``core.sessions.calls``), refusals and a session that ends included. The worker's side
(``worker.session_relay.SessionRelay``) moves rows to a process's stdin and its replies into the store."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.errors import InvalidInput
from core.jobs.models import Job
from core.jobs.service import transition
from core.jobs.states import JobStatus
from core.sessions import calls, relay
from core.sessions.service import adapters_of, build_session_config, create_session, find_live
from core.sessions.spec import SessionSpec
from core.projects import service as projects
from core.settings import Settings
from core.users import service as users
from core.users.service import Caller
from worker.session_relay import SessionRelay


def _caller(session: Session, name: str, project: str | None = None) -> Caller:
    if project:
        projects.create_project(session, project)
    caller = users.caller_of(session, users.create_user(session, name, project_names=[project] if project else None))
    return dataclasses.replace(caller, project_ids=frozenset({caller.project_id}), per_owner=True)


def _settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"session_poll_interval_s": 0.01, "session_start_wait_s": 0.3})


class TestSessionsInTheStore:
    def test_a_session_is_a_queued_job_that_the_same_projects_requests_find(self, box) -> None:
        sessions, settings = box
        with sessions() as session:
            alice, bob = _caller(session, "alice"), _caller(session, "bob", project="other")
            job = create_session(session, alice, SessionSpec(models=["tiny"]), settings=settings)
            session.commit()
            assert (job.kind, job.status, job.gpus, job.training_file_id) == ("session", "queued", 1, None)
            assert adapters_of(job) == {"tiny": "base"}
            assert find_live(session, alice, "tiny", alice.project_id).job_id == job.job_id
            assert find_live(session, bob, "tiny", bob.project_id) is None, "another project's session is not shared"
            config = build_session_config(session, job, settings=settings, output_dir="/x")
            assert (config.model, config.adapters) == (str(settings.model_root / "tiny"), {})
            assert config.max_len == settings.session_max_len and config.idle_timeout_s == settings.session_idle_timeout_s

    def test_models_of_another_project_are_refused(self, box) -> None:
        sessions, settings = box
        with sessions() as session:
            alice = _caller(session, "alice")
            with pytest.raises(InvalidInput) as refused:
                create_session(session, alice, SessionSpec(models=["job:job-0123456789abcdef01234567"]), settings=settings)
            assert refused.value.param == "model"


def _fake_session(sessions: sessionmaker, job_id: str, answer: list[dict], stop: threading.Event) -> None:
    """The worker's side, by hand: ready, then each request answered with ``answer``'s replies."""
    with sessions.begin() as session:
        relay.put_replies(session, job_id, [{"kind": "ready", "adapters": ["base"]}])
    after = 0
    while not stop.wait(0.01):
        with sessions() as session:
            rows = [(r.message_id, r.kind, r.request_id, dict(r.body)) for r in relay.pending(session, job_id, after)]
        for message_id, kind, request_id, body in rows:
            after = message_id
            if kind == "request":
                with sessions.begin() as session:
                    relay.put_replies(session, job_id, [{**reply, "id": request_id} for reply in answer])


class TestRelay:
    def _session(self, box) -> tuple[sessionmaker, Settings, Caller, str]:
        sessions, settings = box
        with sessions() as session:
            alice = _caller(session, "alice")
            job = create_session(session, alice, SessionSpec(models=["tiny"]), settings=settings)
            transition(session, job.job_id, JobStatus.running, only_from=[JobStatus.queued])
            session.commit()
            return sessions, _settings(settings), alice, job.job_id

    def test_a_request_goes_through_and_its_replies_come_back_then_its_rows_go(self, box) -> None:
        sessions, settings, alice, job_id = self._session(box)
        answer = [{"kind": "accepted", "prompt_tokens": 5},
                  {"kind": "delta", "choice": 0, "text": "Hel", "token_ids": [1, 2]},
                  {"kind": "delta", "choice": 0, "text": "lo", "token_ids": [3], "finish_reason": "stop"}]
        stop = threading.Event()
        threading.Thread(target=_fake_session, args=(sessions, job_id, answer, stop), daemon=True).start()
        try:
            call = calls.begin(sessions, alice, "tiny", {"prompt": "hi", "params": {}}, 1, settings, lambda _: None)
            assert call.job_id == job_id and call.prompt_tokens == 5
            got = list(calls.deltas(sessions, call, settings))
        finally:
            stop.set()
        assert "".join(d["text"] for d in got) == "Hello" and got[-1]["finish_reason"] == "stop"
        with sessions() as session:
            assert not relay.has_request(session, call.request_id), "an answered request leaves no rows"

    def test_a_second_request_after_the_first_was_answered_goes_through(self, box) -> None:
        """The worker reads requests past the last id it saw: the second request's id must be above
        the first's although the first's rows were deleted (SQLite reuses ids without AUTOINCREMENT:
        the second message of a conversation on the embedded store waited forever)."""
        sessions, settings, alice, job_id = self._session(box)
        answer = [{"kind": "accepted", "prompt_tokens": 2},
                  {"kind": "delta", "choice": 0, "text": "ok", "token_ids": [1], "finish_reason": "stop"}]
        stop = threading.Event()
        threading.Thread(target=_fake_session, args=(sessions, job_id, answer, stop), daemon=True).start()
        try:
            for turn in ("hi", "and then?"):
                call = calls.begin(sessions, alice, "tiny", {"prompt": turn, "params": {}}, 1, settings, lambda _: None)
                assert "".join(d["text"] for d in calls.deltas(sessions, call, settings)) == "ok", turn
        finally:
            stop.set()

    def test_a_refusal_names_its_param_and_code(self, box) -> None:
        sessions, settings, alice, job_id = self._session(box)
        answer = [{"kind": "error", "code": "context_length_exceeded", "param": "messages", "message": "too long"}]
        stop = threading.Event()
        threading.Thread(target=_fake_session, args=(sessions, job_id, answer, stop), daemon=True).start()
        try:
            with pytest.raises(InvalidInput) as refused:
                calls.begin(sessions, alice, "tiny", {"messages": [], "params": {}}, 1, settings, lambda _: None)
        finally:
            stop.set()
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")

    def test_a_session_that_does_not_load_in_time_answers_starting_with_a_retry_hint(self, box) -> None:
        sessions, settings, alice, job_id = self._session(box)
        with pytest.raises(calls.SessionStarting) as starting:
            calls.begin(sessions, alice, "tiny", {"prompt": "hi", "params": {}}, 1, settings, lambda _: None)
        assert starting.value.retry_after_s > 0 and job_id in starting.value.message

    def test_a_session_that_ended_is_replaced_by_a_new_one(self, box) -> None:
        sessions, settings, alice, job_id = self._session(box)
        with sessions() as session:
            transition(session, job_id, JobStatus.succeeded, only_from=[JobStatus.running])
            session.commit()
        woken: list[str] = []
        with pytest.raises(calls.SessionStarting):
            calls.begin(sessions, alice, "tiny", {"prompt": "hi", "params": {}}, 1, settings, woken.append)
        assert len(woken) == 1 and woken[0] != job_id, "a new session was queued and a worker woken"


class _Process:
    def __init__(self) -> None:
        self.lines: list[dict] = []

    def write_line(self, line: str) -> bool:
        self.lines.append(json.loads(line))
        return True


def test_the_workers_relay_moves_requests_to_stdin_and_replies_to_the_store(box) -> None:
    sessions, settings = box
    with sessions() as session:
        alice = _caller(session, "alice")
        job_id = create_session(session, alice, SessionSpec(models=["tiny"]), settings=settings).job_id
        relay.post(session, job_id, "req-1", "request", {"prompt": "hi", "params": {}, "adapter": "base"})
        session.commit()
    process = _Process()
    runtime = SimpleNamespace(sessionmaker=sessions, settings=_settings(settings))
    worker_side = SessionRelay(runtime, job_id, SimpleNamespace(trainer=process))
    worker_side.start()
    assert not worker_side.take({"type": "log", "message": "x"}), "other events are the recorder's"
    assert worker_side.take({"type": "reply", "kind": "ready", "adapters": ["base"]})
    assert worker_side.take({"type": "reply", "kind": "accepted", "id": "req-1", "prompt_tokens": 2})
    deadline = time.monotonic() + 5
    while not process.lines and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    with sessions() as session:
        assert relay.is_ready(session, job_id) == {"adapters": ["base"]}
        assert [r.kind for r in relay.replies(session, "req-1", 0)] == ["accepted"]
    assert process.lines == [{"op": "request", "id": "req-1", "prompt": "hi", "params": {}, "adapter": "base"}]
    worker_side.stop()
    with sessions() as session:
        assert relay.is_ready(session, job_id) is None and not relay.has_request(session, "req-1")


def test_requests_that_start_a_session_at_once_make_one_and_share_it(box) -> None:
    sessions, settings = box
    with sessions() as session:
        alice = _caller(session, "alice")
        session.commit()
    woken: list[str] = []
    barrier = threading.Barrier(2)
    opened: list[str] = []

    def open_one() -> None:
        barrier.wait()
        opened.append(calls.open_session(sessions, alice, "tiny", settings, woken.append)[0])

    threads = [threading.Thread(target=open_one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with sessions() as session:
        live = session.scalars(select(Job).where(Job.kind == "session", Job.status == "queued")).all()
    assert len(set(opened)) == 1 and [j.job_id for j in live] == opened[:1], (opened, [j.job_id for j in live])


def test_a_waiting_job_of_higher_priority_takes_the_gpu_of_an_idle_session(box) -> None:
    """One host with one GPU held by a running low-priority session; a high-priority training job
    waits for it: the session is asked to end (it drains), while a busy one, or one of the same
    priority, is left."""
    from core.db import utcnow
    from core.sessions.preemption import preempt_idle_sessions
    from core.workers.models import GpuSlot, Worker

    sessions, settings = box
    with sessions() as session:
        alice = _caller(session, "alice")
        chat = create_session(session, alice, SessionSpec(models=["tiny"], priority="low"), settings=settings)
        transition(session, chat.job_id, JobStatus.running, only_from=[JobStatus.queued])
        session.add(Worker(worker_id="box/gpu0", hostname="box", device="cuda:0", started_at=utcnow(),
                           heartbeat_at=utcnow()))
        session.flush()
        session.add(GpuSlot(worker_id="box/gpu0", slot=0, device="0", job_id=chat.job_id, reserved_at=utcnow()))
        relay.post(session, chat.job_id, "req-busy", "request", {})
        session.commit()
        waiting = Job(job_id="job-" + "a" * 24, kind="train", status="queued", model="tiny", method="lora", spec={},
                      priority="low", gpus=1, nodes=1, owner_id=alice.user_id, project_id=alice.project_id,
                      output_dir="/x", created_at=utcnow(), updated_at=utcnow())
        session.add(waiting)
        session.commit()
        assert preempt_idle_sessions(session, settings) == [], "a job of the session's own priority waits"
        waiting.priority = "high"
        session.commit()
        assert preempt_idle_sessions(session, settings) == [], "a busy session finishes its request first"
        relay.forget(session, "req-busy")
        assert preempt_idle_sessions(session, settings) == [chat.job_id]
        session.commit()
        session.refresh(chat)
        assert chat.cancel_requested and chat.status == "running", "it drains, then its worker ends it"
        assert preempt_idle_sessions(session, settings) == [], "asked once"
