"""Keyset (cursor) paging over ``(created_at, id)``, newest first.

A cursor is the position of the last row of a page, opaque to clients (URL-safe base64 of
a small JSON object). Keyset paging, unlike offsets, neither skips nor repeats rows when new
ones are inserted between two page requests: new rows are newer than every cursor.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, or_

from core.errors import InvalidInput

MAX_LIMIT = 200


def encode_cursor(created_at: dt.datetime, row_id: str) -> str:
    raw = json.dumps({"t": created_at.isoformat(), "i": row_id}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        created_at = dt.datetime.fromisoformat(data["t"])
        row_id = data["i"]
        if not isinstance(row_id, str) or created_at.tzinfo is None:
            raise ValueError
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise InvalidInput(
            "after: not a cursor from this API; pass the next_cursor of the previous page, or omit it",
            param="after",
        ) from None
    return created_at, row_id


def page_newest_first(
    query: Select[Any], created_col: Any, id_col: Any, *, limit: int, after: str | None
) -> Select[Any]:
    """Order ``query`` newest first and start it after ``after``; fetches ``limit + 1`` rows
    so the caller can tell whether another page exists."""
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidInput(f"limit: must be between 1 and {MAX_LIMIT}, got {limit}", param="limit")
    if after is not None:
        created_at, row_id = decode_cursor(after)
        older: ColumnElement[bool] = or_(
            created_col < created_at, and_(created_col == created_at, id_col < row_id)
        )
        query = query.where(older)
    return query.order_by(created_col.desc(), id_col.desc()).limit(limit + 1)


def split_page(rows: list[Any], limit: int, created_attr: str, id_attr: str) -> tuple[list[Any], str | None]:
    """The page and the cursor of the next one (None on the last page)."""
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_cursor(getattr(last, created_attr), getattr(last, id_attr))
