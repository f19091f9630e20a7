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

Many viewers of one job (a team watching a run: 100 dashboards) share one read per wake-up:
``JobFeed`` keeps the job's recent events in memory for every stream of this process, and a
stream woken at time t re-reads the store only if no read has started since t (an earlier
viewer's read, begun after the same wake-up, already holds what woke it). Before, each of 100
viewers ran its own two queries per wake-up in the shared thread pool, and submissions queued
behind them (issue 10). A stream that starts behind the feed's window reads its history itself.
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


class JobFeed:
    """The recent events of one job (contiguous seqs, up to ``TAIL``) and its status, read once
    per wake-up for all of this process's streams of the job (see the module docstring)."""

    TAIL = 2000

    def __init__(self, state: AppState, job_id: str) -> None:
        self.state, self.job_id = state, job_id
        self.viewers = 0
        self.events: list[Any] = []
        self.status: tuple[JobStatus, dt.datetime | None, int] | None = None
        self.read_started = float("-inf")
        self._lock = asyncio.Lock()
        self._encoded: dict[int, bytes] = {}

    def encoded(self, event: Any) -> bytes:
        """``event`` as its SSE frame, formatted once for all the viewers of the window."""
        frame = self._encoded.get(event.seq)
        if frame is None:
            frame = format_event(event.seq, event.type, event.data)
            if self.events and self.events[0].seq <= event.seq:
                self._encoded[event.seq] = frame
        return frame

    async def read(self, after: int, woke: float) -> tuple[JobStatus, dt.datetime | None, int, list[Any]]:
        """The job's status, last seq and the events after ``after``, as fresh as ``woke``."""
        async with self._lock:
            if self.status is None or self.read_started < woke:
                await self._refresh()
        assert self.status is not None
        status, finished_at, last_seq = self.status
        if self.events and self.events[0].seq <= after + 1:
            return status, finished_at, last_seq, [e for e in self.events if e.seq > after][:BATCH]
        if not self.events and after >= last_seq:
            return status, finished_at, last_seq, []
        return await to_thread.run_sync(_read, self.state, self.job_id, after)  # history before the window

    async def _refresh(self) -> None:
        self.read_started = time.monotonic()
        since = self.events[-1].seq if self.events else -1
        status, finished_at, last_seq, events = await to_thread.run_sync(_read, self.state, self.job_id, since, True)
        if events and self.events and events[0].seq != self.events[-1].seq + 1:
            self.events = []  # fell more than BATCH behind: start the window again from the tail
        self.events = (self.events + events)[-self.TAIL:]
        self.status = (status, finished_at, last_seq)
        first = self.events[0].seq if self.events else last_seq + 1
        self._encoded = {seq: frame for seq, frame in self._encoded.items() if seq >= first}


def _feed(state: AppState, job_id: str) -> JobFeed:
    feeds = state.feeds
    feed = feeds.get(job_id)
    if feed is None:
        feed = feeds[job_id] = JobFeed(state, job_id)
    feed.viewers += 1
    return feed


def _release(state: AppState, feed: JobFeed) -> None:
    feed.viewers -= 1
    if feed.viewers <= 0 and state.feeds.get(feed.job_id) is feed:
        del state.feeds[feed.job_id]


async def event_stream(state: AppState, job_id: str, after: int) -> AsyncIterator[bytes]:
    settings = state.settings
    pubsub = None
    if state.redis is not None:
        pubsub = state.redis.pubsub()
        await pubsub.subscribe(live.channel(job_id))
    feed = _feed(state, job_id)
    poll = settings.sse_poll_interval_s
    try:
        last_write = woke = time.monotonic()
        yield b"retry: 2000\n\n"
        while True:
            # Polling viewers wake at their own moments: a read of the last interval serves them all.
            status, finished_at, last_seq, events = await feed.read(after, woke - (0 if pubsub else poll))
            if events:  # one write for what this wake-up read (not one per event: 100 viewers of a
                frames, final = [], False  # fast job made thousands of small writes a second)
                for event in events:
                    frames.append(feed.encoded(event))
                    after = event.seq
                    if final := service.is_final_state_event(event.type, event.data):
                        break
                yield b"".join(frames)
                if final:
                    return
                last_write = time.monotonic()
                continue
            if status in FINISHED_STATUSES and after >= last_seq and _past_grace(finished_at):
                return
            if time.monotonic() - last_write >= settings.sse_heartbeat_s:
                yield b": keep-alive\n\n"
                last_write = time.monotonic()
            wait = settings.sse_heartbeat_s - (time.monotonic() - last_write)
            await _wait(pubsub, min(wait, _poll(settings.sse_poll_interval_s, pubsub)))
            woke = time.monotonic()
    finally:
        _release(state, feed)
        if pubsub is not None:
            await pubsub.aclose()


def _read(
    state: AppState, job_id: str, after: int, tail: bool = False
) -> tuple[JobStatus, dt.datetime | None, int, list[Any]]:
    """The job's status and last seq, then the events after ``after`` (read in that order, so
    every event the status row counted is in the events read); with ``tail``, at most the last
    ``BATCH`` of them."""
    with state.sessions() as session:
        job = service.get_job(session, job_id)
        status, finished_at, last_seq = JobStatus(job.status), job.finished_at, job.last_event_seq
        if tail:
            after = max(after, last_seq - BATCH)
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
