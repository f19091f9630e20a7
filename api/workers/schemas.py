from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

from core.workers.models import WorkerKey


class WorkerKeyCreate(BaseModel):
    name: str = Field(description="The key's name, e.g. the machine it is for (lowercase letters, digits, . _ -)")


class WorkerKeyOut(BaseModel):
    """A worker key as it is stored: never the key itself, only its prefix."""

    id: str
    object: Literal["worker_key"] = "worker_key"
    name: str
    prefix: str
    """The 8 hex characters after ``ftqw_``: enough to recognise a key, not to use it."""
    created_at: dt.datetime
    created_by: str | None
    """The id of the admin who made it."""
    last_used_at: dt.datetime | None
    """Updated at most once a minute."""
    revoked_at: dt.datetime | None
    workers: list[str] = []
    """The worker hosts that registered with this key."""

    @classmethod
    def of(cls, row: WorkerKey, workers: list[str] | None = None) -> WorkerKeyOut:
        return cls(
            id=row.worker_key_id, name=row.name, prefix=row.prefix, created_at=row.created_at,
            created_by=row.created_by, last_used_at=row.last_used_at, revoked_at=row.revoked_at,
            workers=workers or [],
        )


class WorkerKeyCreated(BaseModel):
    """A new worker key: ``key`` is shown here once and never again (the store keeps its hash)."""

    id: str
    object: Literal["worker_key"] = "worker_key"
    name: str
    prefix: str
    key: str
    """Set it as FTQ_WORKER_KEY on the worker's machine."""
    created_at: dt.datetime


class WorkerKeyList(BaseModel):
    data: list[WorkerKeyOut]


class ArtifactStored(BaseModel):
    """An upload, unpacked and renamed into the job's artifact store."""

    path: str
    sha256: str
    bytes: int
    files: int
