"""GET /v1/jobs/{id}/events: resume with Last-Event-ID, live delivery (polling and Redis), end."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from core.jobs import live, service
from core.jobs.states import JobStatus
from core.settings import Settings
from tests.fixtures.events import add_steps, events_of, make_job, parse_sse
from tests.integration.helpers import finish, serve

pytestmark = pytest.mark.integration


class TestResume:
    def test_last_event_id_gets_exactly_the_missing_events_then_the_stream_ends(
        self, client: TestClient, store
    ) -> None:
        job_id = make_job(client)  # seq 1: state queued
        add_steps(store, job_id, range(1, 6))  # seq 2..6
        final = finish(store, job_id)  # seq 7
        response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "3"})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = events_of(response.text)
        assert [int(e["id"]) for e in events] == [4, 5, 6, 7]
        assert [e["event"] for e in events] == ["step", "step", "step", "state"]
        assert events[0]["data"] == {"step": 3, "loss": pytest.approx(1 / 3)}
        assert events[-1]["data"] == {"status": "succeeded"} and final == 7

    def test_full_history_from_the_start_and_after_query(self, client: TestClient, store) -> None:
        job_id = make_job(client)
        add_steps(store, job_id, range(1, 3))
        finish(store, job_id, JobStatus.failed)
        everything = events_of(client.get(f"/v1/jobs/{job_id}/events").text)
        assert [(int(e["id"]), e["event"]) for e in everything] == [
            (1, "state"), (2, "step"), (3, "step"), (4, "state")
        ]
        after = events_of(client.get(f"/v1/jobs/{job_id}/events", params={"after": 2}).text)
        assert [int(e["id"]) for e in after] == [3, 4]
        # the browser's reconnect header wins over the URL it reconnects to
        both = client.get(f"/v1/jobs/{job_id}/events", params={"after": 1}, headers={"Last-Event-ID": "3"})
        assert [int(e["id"]) for e in events_of(both.text)] == [4]

    def test_finished_job_without_a_final_state_event_still_ends(self, client: TestClient, store) -> None:
        import datetime as dt

        from core.db import utcnow

        job_id = make_job(client)
        with store.sessions() as session:
            service.transition(session, job_id, JobStatus.running)
            service.transition(session, job_id, JobStatus.failed, finished_at=utcnow() - dt.timedelta(seconds=30))
            session.commit()
        events = events_of(client.get(f"/v1/jobs/{job_id}/events").text)
        assert [(e["event"], e["data"]["status"]) for e in events] == [("state", "queued")]

    def test_bad_last_event_id_is_422(self, client: TestClient, store) -> None:
        job_id = make_job(client)
        for bad in ("abc", "\u00b2".encode("latin-1")):  # "²" is a digit to str.isdigit(), not to int()
            response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": bad})
            assert response.status_code == 422, bad
            assert response.json()["error"]["param"] == "Last-Event-ID"


def stream_in_thread(url: str, headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], threading.Thread]:
    received: list[dict[str, Any]] = []

    def run() -> None:
        with httpx.Client(timeout=30) as http, http.stream("GET", url, headers=headers or {}) as response:
            assert response.status_code == 200
            received.extend(parse_sse(response.iter_lines()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return received, thread


def auth(client: TestClient) -> dict[str, str]:
    """The test client's Authorization header, for requests made with a plain httpx client."""
    return {"Authorization": client.headers["Authorization"]}


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class TestLive:
    def test_polling_stream_delivers_new_events_in_order_and_ends(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        job_id = make_job(client)
        with serve(settings) as server:
            received, thread = stream_in_thread(f"{server.url}/v1/jobs/{job_id}/events", {**auth(client), "Last-Event-ID": "1"})
            time.sleep(0.2)
            add_steps(store, job_id, range(1, 4))
            wait_for(lambda: len([e for e in received if "id" in e]) == 3)
            add_steps(store, job_id, range(4, 6))
            finish(store, job_id)
            thread.join(timeout=10)
            assert not thread.is_alive(), "the stream did not end after the final state"
        events = [e for e in received if "id" in e]
        assert [int(e["id"]) for e in events] == [2, 3, 4, 5, 6, 7]
        assert events[-1]["event"] == "state" and events[-1]["data"]["status"] == "succeeded"

    def test_idle_stream_sends_heartbeats(self, client: TestClient, store, settings: Settings) -> None:
        job_id = make_job(client)
        fast = settings.model_copy(update={"sse_heartbeat_s": 0.2})
        with serve(fast) as server:
            received, thread = stream_in_thread(f"{server.url}/v1/jobs/{job_id}/events", auth(client))
            wait_for(lambda: sum(1 for e in received if e.get("comment") == "keep-alive") >= 2)
            client.post(f"/v1/jobs/{job_id}/cancel")
            thread.join(timeout=10)
            assert not thread.is_alive()
        assert [e["data"]["status"] for e in received if e.get("event") == "state"] == ["queued", "cancelled"]

    def test_redis_wakeups_deliver_without_polling(
        self, client: TestClient, store, settings: Settings, redis_url: str
    ) -> None:
        job_id = make_job(client)
        # A 60 s poll (600 s fallback with Redis): within the 60 s waits below only wake-ups can
        # deliver (not a timing claim: any delivery before the first poll proves it).
        with_redis = settings.model_copy(update={"redis_url": redis_url, "sse_poll_interval_s": 60.0})
        publisher = redis.Redis.from_url(redis_url)
        try:
            with serve(with_redis) as server:
                received, thread = stream_in_thread(f"{server.url}/v1/jobs/{job_id}/events", auth(client))
                wait_for(lambda: any(e.get("event") == "state" for e in received))
                time.sleep(0.1)
                seq = add_steps(store, job_id, range(1, 3))
                publisher.publish(live.channel(job_id), live.message(seq))
                wait_for(lambda: len([e for e in received if e.get("event") == "step"]) == 2, timeout=55.0)
                # the API publishes its own state events (cancel of a queued job)
                with httpx.Client() as http:
                    assert http.post(f"{server.url}/v1/jobs/{job_id}/cancel", headers=auth(client)).status_code == 200
                thread.join(timeout=55.0)
                assert not thread.is_alive()
        finally:
            publisher.close()
        assert [int(e["id"]) for e in received if "id" in e] == [1, 2, 3, 4]


def test_a_waiting_stream_holds_no_store_connection(client: TestClient, store, settings: Settings) -> None:
    import asyncio
    import contextlib

    from api.jobs.sse import event_stream
    from api.state import AppState
    from core.db import make_engine, make_sessionmaker

    job_id = make_job(client)
    engine = make_engine(store.url)
    state = AppState(settings.model_copy(update={"sse_poll_interval_s": 2.0}), engine,
                     make_sessionmaker(engine), celery=None, redis=None)  # type: ignore[arg-type]

    async def run() -> tuple[list[bytes], int]:
        stream = event_stream(state, job_id, 0)
        first = [await anext(stream), await anext(stream)]  # "retry:" and the queued state event
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.5)  # the store was re-read, now it waits for the next poll
        held = engine.pool.checkedout()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await stream.aclose()
        return first, held

    try:
        first, held = asyncio.run(run())
    finally:
        engine.dispose()
    assert first[1].startswith(b"id: 1\nevent: state\n")
    assert held == 0
