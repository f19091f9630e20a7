"""What a job submitted through the OpenAI-compatible API (``api/openai``) keeps beside its
``job`` row: the OpenAI-only fields that ftq's own job spec has no place for.

The job itself is an ordinary ftq job (one store: it shows in ``/v1/jobs``, the CLI and the
dashboard); this row is how ``/openai/v1`` shows it back in OpenAI's shape.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow


class OpenAIJob(Base):
    """The OpenAI view of one ftq job."""

    __tablename__ = "openai_job"

    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), primary_key=True)
    suffix: Mapped[str | None] = mapped_column(String(64))
    """``suffix`` of the request, part of ``fine_tuned_model``."""
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    """``metadata`` of the request (at most 16 string pairs), returned as sent."""
    method: Mapped[dict[str, Any]] = mapped_column(JSONType)
    """``{"type": "supervised" | "dpo", <type>: {"hyperparameters": {...}}}`` with every ``auto``
    resolved to the value the job runs with."""
    training_file: Mapped[str] = mapped_column(String(40))
    """The file id the caller named (what the OpenAI view shows)."""
    validation_file: Mapped[str | None] = mapped_column(String(40))
    """The file id the caller named; the ftq job may train on a ``validation`` twin of it."""
    paused_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    """Set by ``pause`` (the job is stopped with a checkpoint), cleared by ``resume``."""
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
