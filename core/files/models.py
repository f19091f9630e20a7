from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow


class File(Base):
    """An uploaded dataset, validated at upload, stored under the data root."""

    __tablename__ = "file"

    file_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("user.user_id", ondelete="RESTRICT"), index=True)
    """Who uploaded it; None only for files uploaded before users existed."""
    project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="RESTRICT"), index=True)
    """The project it belongs to (``core.projects``); None only for rows no migration could place."""
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    format: Mapped[str] = mapped_column(String(32))
    num_records: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))
    stats: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    """Set by ``DELETE /v1/files/{id}``: the bytes are gone, the row stays for the jobs that used it."""
