"""Removes what finished jobs' uploads left in the API's store (``core.workers.uploads.sweep_finished``).

A job ends wherever ``core.jobs.service.transition`` runs: on a remote worker's machine, which
does not hold the API's disk. So the API sweeps by the ``finished_at`` the transition stamps:
every finished job once at its start (``sweep_all``, called by the lifespan like the
``.incoming/`` sweep), then one thread every ``INTERVAL_S`` the jobs and failed exports that
finished in the last ``WINDOW_S`` (a job is swept more than once, harmlessly: the window covers a
commit seen late, a worker's clock behind the API's, a sweep skipped while an upload held the
job's store lock).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

from sqlalchemy.orm import sessionmaker

from core.db import utcnow
from core.settings import Settings
from core.workers import uploads

log = logging.getLogger(__name__)

INTERVAL_S = 60.0
WINDOW_S = 3600.0


class UploadSweeper:
    def __init__(self, sessions: sessionmaker, settings: Settings, *, interval_s: float = INTERVAL_S,
                 window_s: float = WINDOW_S) -> None:
        self._sessions = sessions
        self._settings = settings
        self._interval_s = interval_s
        self._window_s = window_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep_all(self) -> int:
        """Sweep every finished job; the number of paths removed."""
        return self._sweep(since=None)

    def sweep_recent(self) -> int:
        """Sweep the jobs (and failed exports) that finished in the last ``window_s``."""
        return self._sweep(since=utcnow() - dt.timedelta(seconds=self._window_s))

    def _sweep(self, *, since: dt.datetime | None) -> int:
        try:
            with self._sessions() as session:
                return len(uploads.sweep_finished(session, self._settings, since=since))
        except Exception as exc:  # noqa: BLE001 - the store or the disk is away: the next pass tries again
            log.warning("sweeping finished jobs' uploads failed: %s", exc)
            return 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ftq-upload-sweeper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sweep_recent()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
