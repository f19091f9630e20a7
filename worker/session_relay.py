"""A chat session's side of the relay (``core.sessions.relay``): the worker moves each request the
API queued in the store to the session's stdin, and the session's ``reply`` events back into the
store, one transaction per poll interval (``FTQ_SESSION_POLL_INTERVAL_S``).

Replies never reach the event recorder (they are answers, not the job's history), and no prompt
or output is logged: a failure here logs the job and the exception's type only. Other jobs get
``NoRelay``, the no-op twin.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from core.sessions import relay

if TYPE_CHECKING:
    from worker.executors.base import Executor
    from worker.runtime import Runtime

log = logging.getLogger(__name__)
QUIET_S = 2.0
"""Seconds without a request or a reply after which the relay polls five times less often."""


class NoRelay:
    """A job that is not a session: nothing to relay."""

    def take(self, event: dict[str, Any]) -> bool:
        return False

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class SessionRelay(NoRelay):
    """Moves one session's requests and replies while its trainer runs."""

    def __init__(self, runtime: Runtime, job_id: str, executor: Executor) -> None:
        self.runtime, self.job_id, self.executor = runtime, job_id, executor
        self._replies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"relay-{job_id}", daemon=True)
        self._after = 0

    def take(self, event: dict[str, Any]) -> bool:
        """Keep a ``reply`` event for the store (True); any other event is the recorder's."""
        if event.get("type") != "reply":
            return False
        with self._lock:
            self._replies.append(event)
        return True

    def start(self) -> None:
        with self.runtime.sessionmaker.begin() as session:
            relay.unready(session, self.job_id)  # a retry loads again: not ready until it says so
        self._thread.start()

    def stop(self) -> None:
        """After the trainer exited: the last replies, then every row of the session goes."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._step(forward=False)
        with self.runtime.sessionmaker.begin() as session:
            relay.clear(session, self.job_id)

    def _loop(self) -> None:
        """Every poll interval while requests come and go; five times slower after ``QUIET_S`` without
        any, so an idle session costs a few reads a second, and its next request waits at most that."""
        poll = self.runtime.settings.session_poll_interval_s
        busy_at = time.monotonic()
        while not self._stop.wait(poll if time.monotonic() - busy_at < QUIET_S else poll * 5):
            if self._step(forward=True):
                busy_at = time.monotonic()

    def _step(self, *, forward: bool) -> bool:
        """Relay what there is; whether anything moved."""
        try:
            moved = self._flush()
            return (self._forward() if forward else False) or moved
        except Exception as exc:  # noqa: BLE001 - the next interval tries again; no payload in the log
            log.warning("session %s: relay step failed: %s", self.job_id, type(exc).__name__)
            return False

    def _flush(self) -> bool:
        with self._lock:
            replies, self._replies = self._replies, []
        if replies:
            with self.runtime.sessionmaker.begin() as session:
                relay.put_replies(session, self.job_id, replies)
        return bool(replies)

    def _forward(self) -> bool:
        trainer = getattr(self.executor, "trainer", None)
        if trainer is None:
            return False
        with self.runtime.sessionmaker() as session:
            lines = [(row.message_id, json.dumps({"op": row.kind, "id": row.request_id, **row.body}))
                     for row in relay.pending(session, self.job_id, self._after)]
        for message_id, line in lines:
            if not trainer.write_line(line):
                return False  # the trainer is gone; its exit ends the job
            self._after = message_id
        return bool(lines)


def relay_for(runtime: Runtime, job_id: str, kind: str, executor: Executor) -> NoRelay:
    """A ``SessionRelay`` for a session job, else ``NoRelay``."""
    return SessionRelay(runtime, job_id, executor) if kind == "session" else NoRelay()
