"""api/jobs/wakeups.py: submissions note their job; one thread replays the queue once per batch
of notes and sends each job's wake-up to the host the replay places it on."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

import pytest

from api.jobs import wakeups as module
from core.jobs.placement import Placement
from core.settings import Settings


class Recorder:
    def __init__(self, placed: dict[str, str] | None = None, fail_sends: set[str] | None = None) -> None:
        self.placed = placed or {}
        self.fail_sends = fail_sends or set()
        self.replays = 0
        self.sent: list[tuple[str, str | None]] = []
        self.gate = threading.Event()
        self.gate.set()

    def signal_targets(self, _session: Any, _settings: Settings) -> list[Placement]:
        self.replays += 1
        self.gate.wait(10)
        return [Placement(job_id, host, (0,)) for job_id, host in self.placed.items()]

    def send(self, job_id: str, host: str | None) -> None:
        if job_id in self.fail_sends:
            raise ConnectionError("broker down")
        self.sent.append((job_id, host))


@contextmanager
def _session() -> Any:
    yield object()


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The live hosts ``pool.live_hosts`` reports (none unless a test adds some)."""
    hosts: list[str] = []
    monkeypatch.setattr(module.pool, "live_hosts", lambda _session, cutoff: list(hosts))
    return hosts


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch, live: list[str]) -> Recorder:
    rec = Recorder(placed={"job-a": "host-1"})
    monkeypatch.setattr(module.scheduling, "signal_targets", rec.signal_targets)
    return rec


def _wakeups(rec: Recorder, min_interval_s: float = 0.0) -> module.Wakeups:
    return module.Wakeups(_session, Settings(), None, min_interval_s=min_interval_s, send=rec.send)  # type: ignore[arg-type]


def test_a_placed_job_wakes_its_host_and_a_waiting_one_any_host_while_no_host_is_live(recorder: Recorder) -> None:
    wakeups = _wakeups(recorder)
    wakeups.note("job-a")
    wakeups.note("job-b")
    assert wakeups.flush()
    wakeups.close()
    assert sorted(recorder.sent) == [("job-a", "host-1"), ("job-b", None)]


def test_a_job_that_must_wait_beside_live_hosts_gets_no_message(recorder: Recorder, live: list[str]) -> None:
    # its start is signalled by the worker whose job ends, or by a host that joins
    live.append("host-1")
    wakeups = _wakeups(recorder)
    wakeups.note("job-a")
    wakeups.note("job-b")
    assert wakeups.flush()
    wakeups.close()
    assert recorder.sent == [("job-a", "host-1")]


def test_notes_made_during_a_replay_share_the_next_one(recorder: Recorder) -> None:
    wakeups = _wakeups(recorder)
    recorder.gate.clear()  # the first replay blocks until the notes below are made
    wakeups.note("job-0")
    while recorder.replays == 0:
        threading.Event().wait(0.01)
    for i in range(1, 50):
        wakeups.note(f"job-{i}")
    wakeups.note("job-1")  # noted twice before it was sent: one message
    recorder.gate.set()
    assert wakeups.flush()
    wakeups.close()
    assert recorder.replays == 2
    assert sorted(job for job, _ in recorder.sent) == sorted(f"job-{i}" for i in range(50))


def test_a_refused_send_is_logged_and_the_others_still_go(recorder: Recorder, caplog: pytest.LogCaptureFixture) -> None:
    recorder.fail_sends = {"job-a"}
    wakeups = _wakeups(recorder)
    wakeups.note("job-a")
    wakeups.note("job-b")
    assert wakeups.flush()
    wakeups.note("job-c")
    assert wakeups.flush()
    wakeups.close()
    assert recorder.sent == [("job-b", None), ("job-c", None)]
    assert "job-a committed but not signalled" in caplog.text


def test_an_unreachable_store_still_wakes_any_host(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()

    def broken(_session: Any, _settings: Settings) -> list[Placement]:
        raise OSError("connection refused")

    monkeypatch.setattr(module.scheduling, "signal_targets", broken)
    wakeups = _wakeups(rec)
    wakeups.note("job-a")
    assert wakeups.flush()
    wakeups.close()
    assert rec.sent == [("job-a", None)]


def test_close_sends_what_is_noted_without_waiting_out_the_interval(recorder: Recorder) -> None:
    wakeups = _wakeups(recorder, min_interval_s=60.0)
    wakeups.note("job-a")
    assert wakeups.flush()  # the first replay is at once
    wakeups.note("job-b")  # the next would wait 60 s
    wakeups.close(timeout_s=5)
    assert sorted(recorder.sent) == [("job-a", "host-1"), ("job-b", None)]
