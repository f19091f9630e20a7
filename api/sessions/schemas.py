from __future__ import annotations

import datetime as dt

from pydantic import BaseModel

from core.jobs.models import Job
from core.sessions.service import describe


class SessionOut(BaseModel):
    """A chat session: a job of kind ``session`` (its id is a job id; ``GET /v1/jobs/{id}/events``
    has its history)."""

    id: str
    object: str = "session"
    status: str
    """``queued`` (waiting for a GPU), ``running`` (loading, then answering), ``succeeded`` (ended idle),
    ``cancelled`` (ended by a DELETE or a preemption), ``failed``."""
    ready: bool
    """Its model is loaded and it answers requests."""
    models: list[str]
    name: str | None
    priority: str
    idle_timeout_s: float | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    worker_id: str | None
    error_code: str | None
    error_message: str | None

    @classmethod
    def of(cls, job: Job, ready: bool) -> SessionOut:
        return cls(ready=ready, **describe(job))


class SessionList(BaseModel):
    object: str = "list"
    data: list[SessionOut]
