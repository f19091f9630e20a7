"""The wake-up messages of jobs this API process queued, sent by one background thread.

Which host a queued job should wake is the queue policy replayed over every queued job
(``core.jobs.scheduling.signal_targets``: O(queued jobs)). Replayed once per submission, 20
submissions a second with hundreds of jobs queued spent most of the API's CPU on replays and
made every submission wait for one (issue 10, item 5). Here a request only notes its job id
(``note``, O(1), never waits); the thread replays once for every id noted since its previous
replay and sends each its ``jobs.run`` message: to the host the policy places it on now; a job
that must wait gets none while some host is live (the worker whose job ends signals what can
start then, a host that joins signals what it can take), and a message to any host when none is. Replays start at most every ``min_interval_s``; a note on an idle API
is served at once, so a lone submission reaches its worker as fast as before.

The store stays the source of truth and the message only a wake-up: a note lost with the process
(killed between the commit and the send) or refused by a broker that is down leaves the job
``queued``, and the worker's reaper signals queued jobs that nobody claimed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery import Celery
from sqlalchemy.orm import sessionmaker

from core.jobs import scheduling
from core.workers import pool
from core.queue import enqueue_job
from core.settings import Settings

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0
"""Shortest time between two replays' starts: at most one replay a second, however many
submissions arrive."""


class Wakeups:
    """``note(job_id)`` from any thread; ``close()`` sends what is still noted, then stops."""

    def __init__(
        self,
        sessions: sessionmaker,
        settings: Settings,
        celery: Celery,
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        send: Callable[[str, str | None], None] | None = None,
    ) -> None:
        self._sessions = sessions
        self._settings = settings
        self._send = send or (lambda job_id, host: enqueue_job(celery, job_id, host))
        self._min_interval_s = min_interval_s
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="ftq-wakeups", daemon=True)
        self._thread.start()

    def note(self, job_id: str) -> None:
        """Have ``job_id`` signalled to its host soon (in this process's next replay)."""
        with self._cond:
            if job_id not in self._pending:
                self._pending.append(job_id)
            self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every id noted so far has been sent (or its send failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is noted, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("wake-ups of %d jobs not sent at shutdown (the reaper will signal them)", len(self._pending))

    def _loop(self) -> None:
        last_start = float("-inf")
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:  # closing with nothing left
                    return
                wait = last_start + self._min_interval_s - time.monotonic()
                if wait > 0 and not self._closing:
                    self._cond.wait(wait)  # more notes gather meanwhile; a close cuts it short
                batch, self._pending = self._pending, []
                self._busy = True
            last_start = time.monotonic()
            try:
                self._signal(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _signal(self, job_ids: list[str]) -> None:
        try:
            with self._sessions() as session:
                hosts = {p.job_id: p.worker_id for p in scheduling.signal_targets(session, self._settings)}
                live = bool(pool.live_hosts(session, cutoff=scheduling.live_cutoff(self._settings)))
        except Exception as exc:  # the store is unreachable: wake any host; it places the jobs itself
            log.warning("could not replay the queue for %d wake-ups (%s); sending them to any host", len(job_ids), exc)
            hosts, live = {}, False
        for job_id in job_ids:
            if job_id not in hosts and live:
                # It must wait for a running job to end (whose worker then signals what can start),
                # or for a host to join (which signals what it can take when it registers): a
                # message now would only make a busy worker place the queue for nothing.
                continue
            try:
                self._send(job_id, hosts.get(job_id))
            except Exception as exc:  # the broker is down: the job stays queued for the reaper
                log.warning("job %s committed but not signalled to the workers (broker: %s)", job_id, exc)
