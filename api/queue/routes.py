"""``GET /v1/queue``: the waiting jobs in the order workers will claim them, with start estimates."""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.queue.schemas import QueueOut
from core.jobs import eta
from core.users import access
from core.users.service import names_by_id

router = APIRouter(tags=["jobs"])


@router.get("/v1/queue", summary="Queued jobs in claim order, with positions and estimated start times")
def get_queue(session: SessionDep, state: StateDep, caller: CallerDep) -> QueueOut:
    """Claim order is priority (high, normal, low), then submission time. A job runs on its
    ``gpus`` GPUs of one worker host; the first job that fits no host yet holds the host it waits
    for (``holds``) and later jobs may only use other hosts' GPUs. A job whose owner's running
    jobs hold as many GPUs as their cap allows keeps its position but is passed over until
    one of them ends; ``estimated_start_at`` accounts for all of it (model: core/jobs/eta.py).
    Another project's jobs are in it (they share the GPUs) showing only their project, priority,
    GPUs and times."""
    snap = eta.snapshot(session, state.settings)
    owner_ids = {e.job.owner_id for e in snap.entries} | {r.owner_id for r in snap.running}
    owners = names_by_id(session, owner_ids)
    shown = access.shown_jobs(session, caller, {e.job.job_id for e in snap.entries} | {r.job_id for r in snap.running})
    return QueueOut.of(snap, owners, state.settings.max_running_jobs_per_user, shown)
