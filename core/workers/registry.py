"""The ``worker`` rows: which worker hosts the box knows, and which of them are live.

A worker is live while its heartbeat is younger than ``heartbeat_timeout_s``; each row keeps
the ``python -m trainer detect --json`` report its host sent (``worker.hardware``).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.workers.models import Worker


def live_workers(session: Session, *, cutoff: dt.datetime) -> list[Worker]:
    """The workers whose heartbeat is at or after ``cutoff``, by id."""
    return list(session.scalars(select(Worker).where(Worker.heartbeat_at >= cutoff).order_by(Worker.worker_id)))


def list_workers(session: Session) -> list[Worker]:
    """Every worker the box has known, live or not, by host, device and id."""
    return list(session.scalars(select(Worker).order_by(Worker.hostname, Worker.device, Worker.worker_id)))
