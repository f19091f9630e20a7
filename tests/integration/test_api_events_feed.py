"""Many viewers of one job share one store read per wake-up (``api.jobs.sse.JobFeed``, issue 10:
100 viewers each re-reading the store starved submissions of the thread pool), and each still
gets exactly the events after its own position."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.engine import Engine

from api.jobs.sse import BATCH, JobFeed
from api.state import AppState
from tests.fixtures.events import add_steps, make_job

pytestmark = pytest.mark.integration


class EventReads:
    """Counts the SELECTs on job_event any engine sends while it is open."""

    def __enter__(self) -> EventReads:
        self.count = 0
        event.listen(Engine, "before_cursor_execute", self._on_execute)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(Engine, "before_cursor_execute", self._on_execute)

    def _on_execute(self, conn, cursor, statement, *args) -> None:  # type: ignore[no-untyped-def]
        self.count += "FROM job_event" in statement


def test_fifty_viewers_woken_together_cost_one_read_and_each_gets_its_own_events(
    client: TestClient, store, settings
) -> None:
    job_id = make_job(client)
    last = add_steps(store, job_id, range(1, 31))
    state = AppState(settings, store.engine, store.sessions, celery=None, redis=None)
    feed = JobFeed(state, job_id)
    positions = [i % last for i in range(50)]

    async def wake_all() -> list[list[int]]:
        woke = time.monotonic()
        results = await asyncio.gather(*(feed.read(after, woke) for after in positions))
        return [[e.seq for e in events] for _, _, _, events in results]

    async def scenario() -> None:
        with EventReads() as reads:
            seen = await wake_all()
        assert reads.count == 1
        assert seen == [list(range(after + 1, last + 1)) for after in positions]
        more = add_steps(store, job_id, range(31, 34))
        with EventReads() as reads:
            seen = await wake_all()
        assert reads.count == 1 and all(s[-1] == more for s in seen)

    asyncio.run(scenario())


def test_a_viewer_behind_the_window_reads_its_history_itself(client: TestClient, store, settings) -> None:
    job_id = make_job(client)
    last = add_steps(store, job_id, range(1, BATCH + 40))
    state = AppState(settings, store.engine, store.sessions, celery=None, redis=None)
    feed = JobFeed(state, job_id)

    async def read(after: int) -> list[int]:
        _, _, _, events = await feed.read(after, time.monotonic())
        return [e.seq for e in events]

    async def scenario() -> None:
        assert await read(last - 5) == list(range(last - 4, last + 1))
        assert feed.events[0].seq > 1  # the feed keeps the tail only
        assert await read(0) == list(range(1, BATCH + 1))  # the first page of history, read apart

    asyncio.run(scenario())
