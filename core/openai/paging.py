"""OpenAI's list paging: ``after`` is the id of the last item of the previous page, ``limit`` the
page size (at most ``MAX_LIMIT``), and ``has_more`` says whether another page follows. Newest first, keyset over
``(created_at, id)`` (ties by id), so rows created between two requests never shift a page."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, and_, or_, select
from sqlalchemy.orm import Session

from core.errors import InvalidInput

MAX_LIMIT = 100


def newest_first(session: Session, query: Select[Any], model: Any, id_col: Any, *, after: str | None,
                 limit: int, what: str, scope: ColumnElement[bool]) -> tuple[list[Any], bool]:
    """One page of ``query`` (rows of ``model``), and whether there are more. ``scope``: the
    rows the caller may see (``core.users.access.readable_by``), for the listing and for ``after``,
    so paging after another user's id answers as an unknown id does.

    Raises:
        InvalidInput: ``after`` names no row of this listing, or ``limit`` is below 1.
    """
    if limit < 1:
        raise InvalidInput(f"limit: must be at least 1, got {limit}", param="limit")
    limit = min(limit, MAX_LIMIT)  # a larger ask gets a full page and has_more
    query = query.where(scope)
    if after is not None:
        last = session.scalar(select(model).where(id_col == after, scope))
        if last is None:
            raise InvalidInput(
                f"after: no {what} {after!r}; pass the id of the last {what} of the previous page", param="after"
            )
        query = query.where(or_(model.created_at < last.created_at,
                                and_(model.created_at == last.created_at, id_col < after)))
    rows = list(session.scalars(query.order_by(model.created_at.desc(), id_col.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
