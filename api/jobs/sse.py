"""``GET /v1/jobs/{id}/events``: a job's history, then its live events, as Server-Sent Events.

Each event is ``id: <seq>``, ``event: <type>``, ``data: <json>``. ``seq`` increases by one per
event of the job (``core.jobs.service.append_events``), so a client that reconnects with
``Last-Event-ID: N`` gets exactly the events after N: the stream is a read of
``job_event WHERE seq > N`` repeated, never a relay of messages that could be missed.

Waiting: with Redis the stream subscribes to ``core.jobs.live.channel(job_id)`` *before* its
first read, so a wake-up published between read and wait is not lost, and re-reads the store
on each wake-up (and every ``10 x sse_poll_interval_s`` in case one was missed); without Redis
it re-reads every ``sse_poll_interval_s``. No store connection is held while waiting: each
read opens and closes its own session. An idle stream sends a ``: keep-alive`` comment every
``sse_heartbeat_s``. The stream ends after the job's final ``state`` event (succeeded, failed,
cancelled).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from anyio import to_thread

from api.state import AppState
from core.db import utcnow
from core.jobs import live, service
from core.jobs.states import FINISHED_STATUSES, JobStatus

BATCH = 500
FINISH_GRACE = dt.timedelta(seconds=2)
"""A finished job whose final state event never arrives still ends its stream after this."""


def format_event(seq: int, type_: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), default=str)
    return f"id: {seq}\nevent: {type_}\ndata: {payload}\n\n".encode()


async def event_stream(state: AppState, job_id: str, after: int) -> AsyncIterator[bytes]:
    settings = state.settings
    pubsub = None
    if state.redis is not None:
        pubsub = state.redis.pubsub()
        await pubsub.subscribe(live.channel(job_id))
    try:
        last_write = time.monotonic()
        yield b"retry: 2000\n\n"
        while True:
            status, finished_at, last_seq, events = await to_thread.run_sync(_read, state, job_id, after)
            for event in events:
                yield format_event(event.seq, event.type, event.data)
                after = event.seq
                if service.is_final_state_event(event.type, event.data):
                    return
            if events:
                last_write = time.monotonic()
                continue
            if status in FINISHED_STATUSES and after >= last_seq and _past_grace(finished_at):
                return
            if time.monotonic() - last_write >= settings.sse_heartbeat_s:
                yield b": keep-alive\n\n"
                last_write = time.monotonic()
            wait = settings.sse_heartbeat_s - (time.monotonic() - last_write)
            await _wait(pubsub, min(wait, _poll(settings.sse_poll_interval_s, pubsub)))
    finally:
        if pubsub is not None:
            await pubsub.aclose()


def _read(state: AppState, job_id: str, after: int) -> tuple[JobStatus, dt.datetime | None, int, list[Any]]:
    """The job's status and last seq, then the events after ``after`` (read in that order, so
    every event the status row counted is in the events read)."""
    with state.sessions() as session:
        job = service.get_job(session, job_id)
        status, finished_at, last_seq = JobStatus(job.status), job.finished_at, job.last_event_seq
        events = service.events_after(session, job_id, after, limit=BATCH)
        session.expunge_all()
    return status, finished_at, last_seq, events


def _past_grace(finished_at: dt.datetime | None) -> bool:
    return finished_at is None or utcnow() - finished_at >= FINISH_GRACE


def _poll(interval: float, pubsub: Any) -> float:
    return interval * 10 if pubsub is not None else interval


async def _wait(pubsub: Any, timeout: float) -> None:
    timeout = max(timeout, 0.01)
    if pubsub is None:
        await asyncio.sleep(timeout)
        return
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
    while message is not None:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
