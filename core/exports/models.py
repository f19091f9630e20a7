"""The ``export`` table: one row per export of a finished job (merged safetensors or GGUF)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, Float, ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, UTCDateTime, utcnow


class Export(Base):
    """An export the worker runs (``python -m trainer export``); ``status`` moves
    queued → running → succeeded | failed (``core.exports.service``)."""

    __tablename__ = "export"

    export_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("job.job_id", ondelete="CASCADE"), index=True)
    format: Mapped[str] = mapped_column(String(16))
    """``merged`` or ``gguf``."""
    quantization: Mapped[str | None] = mapped_column(String(16))
    """GGUF tensor type (``f16``, ``q8_0``, ...); None for ``merged``."""
    status: Mapped[str] = mapped_column(String(16), default="queued")
    stage: Mapped[str | None] = mapped_column(String(16))
    """The trainer's current export stage (``trainer.export.STAGES``)."""
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    """Fraction of the whole export done (0..1)."""
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("user.user_id", ondelete="SET NULL"))
    """Who asked for it."""
    project_id: Mapped[str | None] = mapped_column(ForeignKey("project.project_id", ondelete="RESTRICT"), index=True)
    """The project of its job."""
    worker_id: Mapped[str | None] = mapped_column(String(200))
    """The worker host that runs (ran) it: the host holding the job's files."""
    path: Mapped[str | None] = mapped_column(String(1024))
    """The export's directory, under the job's output directory."""
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
