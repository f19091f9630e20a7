"""core.paging: opaque cursors, keyset order, clear errors."""

from __future__ import annotations

import datetime as dt

import pytest

from core.errors import InvalidInput
from core.paging import decode_cursor, encode_cursor, split_page


class Row:
    def __init__(self, t: dt.datetime, i: str) -> None:
        self.created_at, self.row_id = t, i


def test_cursor_round_trips_with_microseconds() -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
    cursor = encode_cursor(when, "job-abc")
    assert "=" not in cursor and "job-abc" not in cursor
    assert decode_cursor(cursor) == (when, "job-abc")


@pytest.mark.parametrize("bad", ["", "!!!", "bm90IGpzb24", encode_cursor.__name__])
def test_bad_cursor_says_what_to_pass(bad: str) -> None:
    with pytest.raises(InvalidInput, match="next_cursor of the previous page") as info:
        decode_cursor(bad)
    assert info.value.param == "after"


def test_split_page_gives_a_cursor_only_when_more_rows_exist() -> None:
    t = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [Row(t - dt.timedelta(seconds=i), f"r{i}") for i in range(3)]
    page, cursor = split_page(rows, 2, "created_at", "row_id")
    assert [r.row_id for r in page] == ["r0", "r1"]
    assert decode_cursor(cursor) == (rows[1].created_at, "r1")
    assert split_page(rows[:2], 2, "created_at", "row_id") == (rows[:2], None)
