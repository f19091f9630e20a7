"""One job's trackers, each fed from a background thread of its own so the job never waits on them.

``Tracking.add`` only appends to each tracker's bounded buffer (the event reader thread calls it
once per trainer event); the tracker's thread drains its buffer in batches. A tracker's first
exception disables it and becomes one warning in the job's events (``warn``), naming the tracker
and the error in ftq's own words (``describe``: a ``TrackerFailure``'s message, such as the HTTP
status; otherwise only the exception's class, never its text, which may carry a tracking server's
response; an ImportError adds the command that installs the ``tracking`` extra). A buffer that fills (a tracker slower than the trainer) drops the newest events
and says so once. ``finish`` queues the end (status and the adapter directory of a job that
succeeded, uploaded where the tracker takes files) and returns at once; the threads are daemons,
so a worker that exits mid-upload leaves that run unfinished on the tracker, never the job.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from core.jobs.trackers import INSTALL

log = logging.getLogger(__name__)

MAX_BUFFERED = 20_000
BATCH = 500


@dataclass(frozen=True)
class JobInfo:
    """What a tracker names a run by and logs as its parameters."""

    job_id: str
    name: str | None
    model: str
    spec: dict[str, Any] = field(default_factory=dict)
    owner: str | None = None
    artifact_dir: Path | None = None
    """Where the final adapter (or full model) will be: uploaded where the tracker takes files,
    if the job succeeds."""


class TrackerFailure(Exception):
    """A tracker's failure in ftq's own words (``HTTP 503 from runs/create``), safe to show in the
    job's events: never built from a server's response body."""


class Tracker(Protocol):
    """One tracking backend; any method may raise: the dispatcher turns that into a warning."""

    label: str
    """For messages: ``MLflow server team``."""

    def start(self, job: JobInfo) -> None: ...

    def log(self, events: list[dict[str, Any]]) -> None: ...

    def finish(self, status: str, artifact_dir: Path | None) -> None: ...


class Tracking:
    """The trackers of one job run, each on a thread of its own (a slow one holds up no other);
    with none, every method is a no-op and no thread starts."""

    def __init__(self, trackers: list[Tracker], job: JobInfo, warn: Callable[[str], None]) -> None:
        self._job = job
        self._lanes = [_Lane(tracker, job, warn) for tracker in trackers]

    @property
    def active(self) -> bool:
        return bool(self._lanes)

    def add(self, event: dict[str, Any]) -> None:
        for lane in self._lanes:
            lane.add(event)

    def finish(self, status: str) -> None:
        """The run ended with ``status`` (the job's, or ``lost``); returns at once."""
        artifact = self._job.artifact_dir if status == "succeeded" else None
        for lane in self._lanes:
            lane.finish(status, artifact)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every tracker's thread to end (after ``finish``); True when all have."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self._lanes:
            lane.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(lane.thread.is_alive() for lane in self._lanes)


class _Lane:
    """One tracker's buffer and thread."""

    def __init__(self, tracker: Tracker, job: JobInfo, warn: Callable[[str], None]) -> None:
        self.tracker = tracker
        self._job = job
        self._warn = warn
        self._alive = True
        self._buffer: collections.deque[dict[str, Any]] = collections.deque()
        self._end: tuple[str, Path | None] | None = None
        self._ready = threading.Condition()
        self._dropped = 0
        self.thread = threading.Thread(target=self._run, name=f"tracking-{job.job_id}", daemon=True)
        self.thread.start()

    def add(self, event: dict[str, Any]) -> None:
        if not self._alive:
            return
        with self._ready:
            if len(self._buffer) >= MAX_BUFFERED:
                self._dropped += 1
                return
            self._buffer.append(event)
            self._ready.notify()

    def finish(self, status: str, artifact: Path | None) -> None:
        with self._ready:
            self._end = (status, artifact)
            self._ready.notify()

    def _run(self) -> None:
        self._call("start", self._job)
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._buffer or self._end is not None)
                batch = [self._buffer.popleft() for _ in range(min(BATCH, len(self._buffer)))]
                end = self._end if not self._buffer else None
            if batch:
                self._call("log", batch)
            if end is not None:
                if self._dropped and self._alive:
                    self._warn(f"{self.tracker.label} fell behind: {self._dropped} events were not sent")
                self._call("finish", *end)
                return

    def _call(self, method: str, *args: Any) -> None:
        if not self._alive:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as exc:  # noqa: BLE001 - any tracker failure is a warning, never the job's
            self._alive = False
            with self._ready:
                self._buffer.clear()
            log.warning("job %s: %s failed (%s): %s", self._job.job_id, self.tracker.label, method, describe(exc))
            fix = f"; to track with it, {INSTALL}" if isinstance(exc, ImportError) else ""
            self._warn(f"{self.tracker.label}: {describe(exc)}; the job goes on without it{fix}")


def describe(exc: BaseException) -> str:
    """``exc`` for the job's events: the first line of ftq's own message (a ``TrackerFailure``) or
    of a missing package's (ImportError); for anything else its class alone (``ConnectError``,
    ``CommError``), as a library's text may quote what a server answered."""
    if not isinstance(exc, (TrackerFailure, ImportError)):
        return type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
