from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import BaseModel

from api.jobs.schemas import PlanOut


class GpuOut(BaseModel):
    """One GPU of a worker host's pool (a CPU slot on a box without GPUs)."""

    slot: int
    device: str | None
    """As CUDA_VISIBLE_DEVICES names it (index or UUID); null for a CPU slot."""
    job: str | None
    """The job holding it, null when free."""


class WorkerOut(BaseModel):
    id: str
    hostname: str
    device: str
    """``cuda:0,1,3`` (the GPUs it holds) or ``cpu``."""
    gpus: list[GpuOut]
    """Its pool: a job of N GPUs runs on N of them."""
    hardware: dict[str, Any]
    """What ``python -m trainer detect --json`` reported on the worker's device."""
    plan: PlanOut | None
    """The optimization plan the trainer would choose there (``hardware["plan"]`` when reported)."""
    current_job: str | None
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float
    alive: bool
    """Heartbeat younger than FTQ_HEARTBEAT_TIMEOUT_S."""


class HardwareList(BaseModel):
    data: list[WorkerOut]


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    checks: dict[str, str]
    """``ok`` or why the dependency is unreachable, for store, broker and (if configured) redis."""
