from __future__ import annotations

import datetime as dt

from sqlalchemy import Boolean, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, UTCDateTime, utcnow


class User(Base):
    """A person (or service account) on the box. Owns jobs and files."""

    __tablename__ = "user"

    user_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    max_running_jobs: Mapped[int | None] = mapped_column(Integer)
    """Per-user cap on concurrently running jobs; None uses ``FTQ_MAX_RUNNING_JOBS_PER_USER``."""
    default_project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="SET NULL"))
    """The project the user's work goes to when a request names none (one of their projects)."""
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    disabled_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)


class ApiKey(Base):
    """An API key, stored hashed: only ``prefix`` (for lookup) and the SHA-256 of the whole key.

    Keys are 32 random bytes (``ftq_<prefix>_<secret>``), so a fast hash is enough: there is
    nothing to brute-force that a slow password hash would protect.
    """

    __tablename__ = "api_key"

    api_key_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("user.user_id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(100))
    project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="SET NULL"))
    """The key's default project (as an OpenAI project key); None: the user's default project."""
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
