from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow


class SessionMessage(Base):
    """One message of the relay between the API and a session's worker (``core.sessions.relay``):
    a request or a cancel on its way to the session, or a reply on its way back. Rows live only
    while their request runs: the API deletes a request's rows when it has answered, the worker
    a session's when the session ends."""

    __tablename__ = "session_message"
    __table_args__ = {"sqlite_autoincrement": True}
    """Ids are never reused (SQLite's default reuses the largest after a delete): the worker reads
    requests past the last id it saw (``core.sessions.relay.pending``)."""

    message_id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                            autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), index=True)
    request_id: Mapped[str | None] = mapped_column(String(40), index=True)
    """The request it belongs to; None for the session's own ``ready``."""
    kind: Mapped[str] = mapped_column(String(16))
    """To the session: ``request``, ``cancel``. From it: ``ready``, ``accepted``, ``delta``, ``error``."""
    body: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
