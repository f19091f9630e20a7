"""Job operations shared by the API and the worker. Each takes a session; the caller commits."""

from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db import utcnow
from core.jobs.models import Job, JobEvent
from core.jobs.states import FINISHED_STATUSES, JobStatus, sources_of


def transition(
    session: Session,
    job_id: str,
    target: JobStatus,
    *,
    only_from: Iterable[JobStatus] | None = None,
    **values: Any,
) -> bool:
    """Move a job to ``target`` if its current status allows it; True if this call won.

    One conditional ``UPDATE ... WHERE status IN (...)``: of two processes racing for the same
    transition exactly one sees a row updated. ``only_from`` narrows the allowed sources
    (e.g. claim only from ``queued``). ``values`` are further columns to set in the same update.
    """
    sources = sources_of(target)
    if only_from is not None:
        sources = sources & frozenset(only_from)
    now = utcnow()
    values = dict(values)
    values.setdefault("updated_at", now)
    if target is JobStatus.running:
        values.setdefault("started_at", now)
    if target in FINISHED_STATUSES:
        values.setdefault("finished_at", now)
    result = session.execute(
        update(Job)
        .where(Job.job_id == job_id, Job.status.in_([s.value for s in sources]))
        .values(status=target.value, **values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def append_events(session: Session, job_id: str, events: list[tuple[str, dict[str, Any]]]) -> list[JobEvent]:
    """Append events to a job's history with consecutive ``seq`` numbers, in one statement each.

    The job row is locked (``SELECT ... FOR UPDATE`` on PostgreSQL; SQLite serialises writers)
    while ``last_event_seq`` is advanced, so concurrent writers (worker, API cancel) never reuse
    a seq and a reader that saw seq N has seen every seq below it once both commit.
    """
    if not events:
        return []
    last = session.execute(
        select(Job.last_event_seq).where(Job.job_id == job_id).with_for_update()
    ).scalar_one()
    rows = [
        JobEvent(job_id=job_id, seq=last + i + 1, type=type_, data=data)
        for i, (type_, data) in enumerate(events)
    ]
    session.add_all(rows)
    session.execute(
        update(Job).where(Job.job_id == job_id).values(last_event_seq=last + len(rows))
        .execution_options(synchronize_session=False)
    )
    session.flush()
    return rows


def state_event(status: JobStatus, **extra: Any) -> tuple[str, dict[str, Any]]:
    """The ``state`` event recorded with every transition."""
    return ("state", {"status": status.value, **extra})
