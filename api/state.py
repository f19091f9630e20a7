"""The typed state the lifespan hands to every request (``request.state.ftq``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.orm import sessionmaker

from api.files.tokenizer_pool import TokenizerPool
from api.jobs.wakeups import Wakeups
from core.settings import Settings


@dataclass(frozen=True)
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker
    celery: Celery
    redis: Any | None
    """``redis.asyncio.Redis`` when FTQ_REDIS_URL is set, else None (SSE polls the store)."""
    tokenizers: TokenizerPool | None = None
    """The processes that tokenize datasets for GET /v1/files/{id}/tokens; the lifespan creates
    it (None only in a state a test builds by hand) and shuts it down at exit."""
    feeds: dict[str, Any] = field(default_factory=dict)
    """``api.jobs.sse.JobFeed`` per job with live viewers in this process (one store read per
    wake-up for all of them)."""
    wakeups: Wakeups | None = None
    """Sends queued jobs' wake-up messages from one thread (``api.jobs.wakeups``); the lifespan
    creates it and closes it at exit (None only in a state a test builds by hand)."""
