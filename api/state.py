"""The typed state the lifespan hands to every request (``request.state.ftq``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from core.settings import Settings


@dataclass(frozen=True)
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker
    celery: Celery
    redis: Any | None
    """``redis.asyncio.Redis`` when FTQ_REDIS_URL is set, else None (SSE polls the store)."""
