"""``/v1/hardware``, ``/healthz`` (the process answers) and ``/readyz`` (its dependencies do)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from anyio import to_thread
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.errors import error_body
from api.state import AppState
from api.jobs.schemas import PlanOut
from api.system.schemas import GpuOut, HardwareList, Health, MachineGpuOut, MachineOut, Readiness, WorkerOut
from core.db import ping, utcnow
from core.users import access
from core.workers import pool, registry
from core.workers.models import GpuSlot, Worker

router = APIRouter(tags=["system"])

CHECK_TIMEOUT_S = 3.0


@router.get("/v1/hardware", summary="Worker hosts of this box and the machines they run on: their GPUs and the jobs holding them, detected hardware, plan, liveness")
def hardware(session: SessionDep, state: StateDep, caller: CallerDep) -> HardwareList:
    """Each GPU shows the project holding it; the job's id only to those who may read the job."""
    now = utcnow()
    timeout = state.settings.heartbeat_timeout_s
    rows = registry.list_workers(session)
    pools = pool.pools(session)
    held = {g.job_id for slots in pools.values() for g in slots if g.job_id} | {r.current_job_id for r in rows if r.current_job_id}
    shown = access.shown_jobs(session, caller, held)
    workers = [_worker_out(row, pools.get(row.worker_id, []), now, timeout, shown) for row in rows]
    return HardwareList(data=workers, machines=machines_of(workers))


def _worker_out(row: Worker, slots: list[GpuSlot], now: dt.datetime, timeout: float,
                shown: dict[str, tuple[bool, str | None]]) -> WorkerOut:
    age = max((now - row.heartbeat_at).total_seconds(), 0.0)
    hw = dict(row.hardware or {})
    trackers = hw.pop("trackers", None)
    pool_report = _shown_pool(hw.pop("pool", None), shown)
    return WorkerOut(
        id=row.worker_id,
        hostname=row.hostname,
        machine=row.hostname,
        address=row.address,
        remote=row.key_id is not None,
        shared_dir=row.shared_dir,
        shared_id=row.shared_id,
        device=row.device,
        gpus=[GpuOut(slot=g.slot, device=g.device, job=g.job_id if shown.get(g.job_id or "", (False,))[0] else None,
                     project=shown.get(g.job_id or "", (False, None))[1]) for g in slots],
        # `python -m trainer detect --json` prints {"hardware": {...}, "plan": {...}}
        hardware=hw.get("hardware", hw) if isinstance(hw.get("hardware"), dict) else hw,
        plan=PlanOut.of(hw.get("plan")),
        trackers=trackers if isinstance(trackers, dict) else None,
        pool=pool_report,
        current_job=row.current_job_id if shown.get(row.current_job_id or "", (False,))[0] else None,
        started_at=row.started_at,
        heartbeat_at=row.heartbeat_at,
        heartbeat_age_s=round(age, 3),
        alive=age < timeout,
    )


def _shown_pool(report: Any, shown: dict[str, tuple[bool, str | None]]) -> dict[str, Any] | None:
    """A bridge's pool report, each Slurm job's ftq id only to those who may read that job."""
    if not isinstance(report, dict):
        return None
    cluster = dict(report.get("cluster") or {})
    cluster["jobs"] = [{**job, "job_id": job.get("job_id") if shown.get(job.get("job_id") or "", (False,))[0] else None}
                       for job in cluster.get("jobs") or [] if isinstance(job, dict)]
    return {**report, "cluster": cluster}


def machines_of(workers: list[WorkerOut]) -> list[MachineOut]:
    """Workers grouped by machine (hostname and address), in the workers' order; a machine is
    ``lost`` when none of its workers is alive."""
    groups: dict[tuple[str, str | None], list[WorkerOut]] = {}
    for worker in workers:
        groups.setdefault((worker.hostname, worker.address), []).append(worker)
    out = []
    for (name, address), members in groups.items():
        newest = min(members, key=lambda w: w.heartbeat_age_s)
        gpus = [MachineGpuOut(worker=w.id, **g.model_dump()) for w in members for g in w.gpus]
        out.append(
            MachineOut(
                name=name,
                address=address,
                status="live" if any(w.alive for w in members) else "lost",
                heartbeat_at=newest.heartbeat_at,
                heartbeat_age_s=newest.heartbeat_age_s,
                remote=any(w.remote for w in members),
                workers=[w.id for w in members],
                gpus=gpus,
                jobs=list(dict.fromkeys(g.job for g in gpus if g.job)),
            )
        )
    return out


@router.get("/healthz", summary="The API process is up")
async def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    summary="The store and the broker (and Redis, if configured) are reachable",
    responses={503: {"description": "error.message names what is down; checks has each result"}},
)
async def readyz(state: StateDep) -> Readiness:
    checks = {
        "store": lambda: to_thread.run_sync(_check_store, state),
        "broker": lambda: to_thread.run_sync(_check_broker, state),
    }
    if state.redis is not None:
        checks["redis"] = lambda: asyncio.wait_for(state.redis.ping(), CHECK_TIMEOUT_S)  # type: ignore[union-attr]
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            await check()
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"unreachable: {type(exc).__name__}: {exc}"[:300]
    down = [name for name, result in results.items() if result != "ok"]
    if down:
        message = "not ready: " + "; ".join(f"{name} {results[name]}" for name in down)
        body = error_body("unavailable", message, param=None)
        return JSONResponse({**body, "checks": results}, status_code=503)  # type: ignore[return-value]
    return Readiness(status="ready", checks=results)


def _check_store(state: AppState) -> None:
    ping(state.engine)


def _check_broker(state: AppState) -> None:
    with state.celery.connection_for_write(connect_timeout=CHECK_TIMEOUT_S) as conn:
        conn.ensure_connection(max_retries=1, timeout=CHECK_TIMEOUT_S)
