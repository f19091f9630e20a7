"""bench.service_overhead on a temporary SQLite store: it times both sides and prints its table."""

from __future__ import annotations

import pytest

from bench import service_overhead


def test_runs_on_a_fresh_sqlite_store_and_prints_the_shares(capsys: pytest.CaptureFixture[str]) -> None:
    assert service_overhead.main(["--events", "40", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "40 step events" in out
    rows = [line for line in out.splitlines() if line.startswith(("| trainer", "| worker"))]
    assert len(rows) == 2 and "sqlite, 8 per batch" in rows[1]
    assert all(line.count("%") == len(service_overhead.STEP_MS) for line in rows)


def test_record_writes_every_event_to_the_store() -> None:
    times = service_overhead.time_record(25, 10, None)  # raises unless the store took all 25
    assert len(times) == 3 and all(t > 0 for t in times)  # batches of 10, 10, 5


def test_bad_counts_are_refused() -> None:
    with pytest.raises(SystemExit):
        service_overhead.main(["--events", "0"])
