"""The relay between the API and a chat session: rows of ``session_message`` in the store.

    API      post(request)  ──►  session_message  ──►  worker (worker.session_relay): the session's stdin
    API  ◄── replies(after) ◄──  session_message  ◄──  worker: the session's ``reply`` events

Why the store: it is the one thing every part already reaches on both stacks (SQLite + the
embedded broker, PostgreSQL + Redis), a worker on another machine included (the store is its
channel for claims and events: worker/remote.py), and nothing connects to a worker. Both sides
poll (``FTQ_SESSION_POLL_INTERVAL_S``, 50 ms): each hop adds up to one interval, and the worker
writes the replies of one interval in one transaction, so a stream arrives in chunks of about
50 ms of tokens and costs about 20 small transactions a second per running session and one
indexed read per waiting request. That is sized for people chatting and scripts, not for
high-throughput serving (batch generation jobs are for that). Rows live only while their
request runs: the API deletes a request's rows once it answered (``forget``), the worker a
session's when it ends (``clear``). Prompts and outputs pass through the store this way but are
never written to a log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from core.sessions.models import SessionMessage

TO_SESSION = ("request", "cancel")
REPLIES = ("accepted", "delta", "error")
READY = "ready"


def post(session: Session, job_id: str, request_id: str, kind: str, body: dict[str, Any]) -> None:
    """Queue a ``request`` or a ``cancel`` for the session ``job_id``; the caller commits."""
    assert kind in TO_SESSION, kind
    session.add(SessionMessage(job_id=job_id, request_id=request_id, kind=kind, body=body))


def is_ready(session: Session, job_id: str) -> dict[str, Any] | None:
    """The session's ``ready`` reply (adapters, max_len) once its model is loaded, else None."""
    return session.scalar(select(SessionMessage.body).where(SessionMessage.job_id == job_id,
                                                            SessionMessage.kind == READY).limit(1))


def replies(session: Session, request_id: str, after: int) -> list[SessionMessage]:
    """The request's replies past message ``after``, in order."""
    return list(session.scalars(
        select(SessionMessage).where(SessionMessage.request_id == request_id, SessionMessage.kind.in_(REPLIES),
                                     SessionMessage.message_id > after).order_by(SessionMessage.message_id)))


def forget(session: Session, request_id: str) -> None:
    """Delete a request's rows (it was answered, or its client went away)."""
    session.execute(delete(SessionMessage).where(SessionMessage.request_id == request_id))


def pending(session: Session, job_id: str, after: int) -> list[SessionMessage]:
    """Requests and cancels for ``job_id`` past message ``after``, in order (the worker's read)."""
    return list(session.scalars(
        select(SessionMessage).where(SessionMessage.job_id == job_id, SessionMessage.kind.in_(TO_SESSION),
                                     SessionMessage.message_id > after).order_by(SessionMessage.message_id)))


def put_replies(session: Session, job_id: str, events: Sequence[dict[str, Any]]) -> None:
    """Store a session's ``reply`` events (``trainer.generate.session``); a ``ready`` replaces the last."""
    for event in events:
        kind = event.get("kind")
        if kind == READY:
            session.execute(delete(SessionMessage).where(SessionMessage.job_id == job_id, SessionMessage.kind == READY))
        elif kind not in REPLIES:
            continue
        body = {k: v for k, v in event.items() if k not in ("type", "time", "kind", "id")}
        session.add(SessionMessage(job_id=job_id, request_id=event.get("id"), kind=kind, body=body))


def has_request(session: Session, request_id: str) -> bool:
    return bool(session.scalar(select(exists().where(SessionMessage.request_id == request_id))))


def clear(session: Session, job_id: str) -> None:
    """Delete every row of the session ``job_id`` (it ended, or a new attempt starts: not ready yet)."""
    session.execute(delete(SessionMessage).where(SessionMessage.job_id == job_id))


def unready(session: Session, job_id: str) -> None:
    """A new attempt of the session is loading: forget the last attempt's ``ready``."""
    session.execute(delete(SessionMessage).where(SessionMessage.job_id == job_id, SessionMessage.kind == READY))
