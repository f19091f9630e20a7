"""One chat or completion request through a session, as the API's routes run it (in a thread).

    open_session   the model's name → a live session of the caller's project that serves it, or a
                   new one (queued; the caller wakes a worker)
    wait_ready     until the session's model is loaded (``relay.is_ready``), up to
                   ``FTQ_SESSION_START_WAIT_S``; then ``SessionStarting`` (503 with a retry hint)
    start          the request into the relay, then its ``accepted`` (the prompt's tokens) or its
                   refusal (``InvalidInput`` naming the field, e.g. a prompt + max_tokens beyond the
                   session's context: code ``context_length_exceeded``)
    deltas         its deltas until every choice finished; a client that goes away cancels it

A session that ends between being found and taking the request (it went idle at that moment, or was
preempted) is replaced once by a new one within the same wait. Nothing here logs a prompt or an output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db import new_id
from core.errors import InvalidInput, ModelNotFound, Unavailable
from core.jobs.models import Job
from core.openai import catalog
from core.sessions import relay
from core.sessions.service import LIVE, adapters_of, create_session, find_live, start_key_for
from core.sessions.spec import SessionSpec
from core.settings import Settings
from core.users import access
from core.users.service import Caller

Sessions = Callable[[], AbstractContextManager[Session]]
STATUS_EVERY_S = 1.0
"""How often a waiting request reads its session's status (a session that ended answers 503)."""


class SessionStarting(Unavailable):
    """The model's session is still queued or loading after the stated wait (503 + ``Retry-After``)."""

    code = "session_starting"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, param="model")
        self.retry_after_s = retry_after_s


class SessionEnded(Unavailable):
    code = "session_ended"


@dataclass
class Call:
    """A request the session accepted."""

    job_id: str
    request_id: str
    prompt_tokens: int
    n: int


def begin(sessions: Sessions, caller: Caller, model: str, payload: dict[str, Any], n: int, settings: Settings,
          wake: Callable[[str], None]) -> Call:
    """``open_session``, ``wait_ready`` and ``start`` within ``FTQ_SESSION_START_WAIT_S``; a session
    that ended on the way is replaced once."""
    deadline = time.monotonic() + settings.session_start_wait_s
    for attempt in range(2):
        try:
            job_id, adapter = open_session(sessions, caller, model, settings, wake)
            wait_ready(sessions, job_id, deadline, settings)
            return start(sessions, job_id, adapter, payload, n, max(deadline, time.monotonic() + 30), settings)
        except SessionEnded:
            if attempt:
                raise
    raise AssertionError("unreachable")


def open_session(sessions: Sessions, caller: Caller, model: str, settings: Settings,
                 wake: Callable[[str], None]) -> tuple[str, str]:
    """``(session job id, adapter name)`` for ``model``, starting a session when none is live.

    Raises:
        ModelNotFound: a model the caller may not read (``core.openai.catalog``).
    """
    with sessions() as session:
        ref = catalog.reference(session, caller, model, settings.model_root)
        project_id = access.project_for_create(session, caller, None)
        job = find_live(session, caller, ref, project_id)
        if job is not None:
            return job.job_id, adapters_of(job)[ref]
        try:
            # Requests that found none at once (two columns of the playground) compute one key: one makes it.
            mine = create_session(session, caller, SessionSpec(models=[ref]), settings=settings,
                                  start_key=start_key_for(session, caller, ref, project_id))
            mine_id, adapter = mine.job_id, adapters_of(mine)[ref]
            session.commit()
        except IntegrityError:
            session.rollback()
            job = find_live(session, caller, ref, project_id)
            if job is None:
                raise SessionEnded("the session another request started ended at once; send the request again",
                                   param="model") from None
            return job.job_id, adapters_of(job)[ref]
    wake(mine_id)
    return mine_id, adapter


def wait_ready(sessions: Sessions, job_id: str, deadline: float, settings: Settings) -> None:
    """Return once the session's model is loaded.

    Raises:
        SessionStarting: still queued or loading at ``deadline`` (monotonic seconds).
        SessionEnded: the session ended meanwhile.
    """
    while True:
        with sessions() as session:
            _check_live(session, job_id)  # first: a session that failed may have left its ready row
            if relay.is_ready(session, job_id) is not None:
                return
        if time.monotonic() >= deadline:
            raise SessionStarting(
                f"The model is loading in a new session ({job_id}), which took longer than this request may wait "
                f"({settings.session_start_wait_s:g} s, FTQ_SESSION_START_WAIT_S). Retry in a few seconds; "
                f"GET /v1/sessions/{job_id} shows its state.", retry_after_s=5)
        time.sleep(settings.session_poll_interval_s)


def start(sessions: Sessions, job_id: str, adapter: str, payload: dict[str, Any], n: int, deadline: float,
          settings: Settings) -> Call:
    """Post the request (``payload``: messages or prompt, and params) and wait for its acceptance.

    Raises:
        InvalidInput: the session refused it (its ``code`` and ``param`` as the session says).
        SessionEnded: the session ended before it took the request.
    """
    request_id = new_id("chatcmpl")
    with sessions() as session:
        relay.post(session, job_id, request_id, "request", {**payload, "adapter": adapter})
        session.commit()
    try:
        for reply in _follow(sessions, job_id, request_id, deadline, settings):
            if reply.kind == "accepted":
                return Call(job_id, request_id, int(reply.body["prompt_tokens"]), n)
            raise _refusal(reply.body)
        raise SessionEnded(f"session {job_id} ended before it took the request; send it again", param="model")
    except BaseException:
        _forget(sessions, request_id)
        raise


def deltas(sessions: Sessions, call: Call, settings: Settings) -> Iterator[dict[str, Any]]:
    """The call's delta bodies (``trainer.generate.session``'s) until each choice has its finish reason.
    Closing the iterator early cancels the request; the request's rows are deleted either way.

    Raises:
        SessionEnded: the session ended or failed mid-answer.
    """
    finished = 0
    try:
        for reply in _follow(sessions, call.job_id, call.request_id, None, settings):
            if reply.kind == "error":
                raise SessionEnded(f"the session failed while answering: {reply.body.get('message')}")
            if reply.kind != "delta":
                continue
            yield reply.body
            finished += reply.body.get("finish_reason") is not None
            if finished >= call.n:
                return
        raise SessionEnded(f"session {call.job_id} ended while answering; send the request again")
    finally:
        if finished < call.n:
            with sessions() as session:
                relay.post(session, call.job_id, call.request_id, "cancel", {})
                session.commit()
        _forget(sessions, call.request_id)


def _follow(sessions: Sessions, job_id: str, request_id: str, deadline: float | None,
            settings: Settings) -> Iterator[Any]:
    """The request's replies as they come; ends when the session is no longer live, or at ``deadline``."""
    after, checked = 0, time.monotonic()
    while True:
        with sessions() as session:
            rows = relay.replies(session, request_id, after)
            session.expunge_all()
            if not rows and time.monotonic() - checked >= STATUS_EVERY_S:
                checked = time.monotonic()
                if session.get(Job, job_id, populate_existing=True).status not in LIVE:
                    return
        for row in rows:
            after = row.message_id
            yield row
        if deadline is not None and time.monotonic() >= deadline:
            return
        if not rows:
            time.sleep(settings.session_poll_interval_s)


def _check_live(session: Session, job_id: str) -> None:
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.status not in LIVE:
        raise SessionEnded(f"session {job_id} ended ({job.status if job else 'deleted'}"
                           + (f": {job.error_message}" if job is not None and job.error_message else "")
                           + "); send the request again to start another", param="model")


def _refusal(body: dict[str, Any]) -> Exception:
    message, param, code = str(body.get("message", "refused")), body.get("param"), body.get("code")
    if code == "model_not_found":
        return ModelNotFound(message, param="model")
    if code == "session_ending":
        return SessionEnded(message, param="model")
    error = InvalidInput(message, param=param)
    error.code = str(code or "invalid_value")
    return error


def _forget(sessions: Sessions, request_id: str) -> None:
    with sessions() as session:
        relay.forget(session, request_id)
        session.commit()
