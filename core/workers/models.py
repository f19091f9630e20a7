from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow


class Worker(Base):
    """A worker process (one per GPU) as it last reported itself."""

    __tablename__ = "worker"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(64))
    """``cuda:0``-style name of the device the worker owns (after CUDA_VISIBLE_DEVICES), or ``cpu``."""
    hardware: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    """Output of ``python -m trainer detect --json``: the hardware and the plan on it."""
    current_job_id: Mapped[str | None] = mapped_column(String(40))
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
