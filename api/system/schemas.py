from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel

from api.jobs.schemas import PlanOut


class GpuOut(BaseModel):
    """One GPU of a worker host's pool (a CPU slot on a box without GPUs)."""

    slot: int
    device: str | None
    """As CUDA_VISIBLE_DEVICES names it (index or UUID); null for a CPU slot."""
    job: str | None
    """The job holding it, null when free or when the job is another project's (see ``project``)."""
    project: str | None = None
    """The project whose job holds it (shown to everyone: GPUs are shared by scheduling)."""


class WorkerOut(BaseModel):
    id: str
    hostname: str
    machine: str
    """The name of the machine it runs on (``machines[].name``)."""
    address: str | None
    """Where other machines reach it (torchrun's rendezvous); null when it did not say."""
    remote: bool
    """It runs with a worker key (no shared disk; bytes go through the API)."""
    shared_dir: str | None = None
    """The shared checkpoint directory its machine mounts (FTQ_SHARED_DIR); null: none."""
    shared_id: str | None = None
    """The id in that directory's marker: workers with the same ``shared_dir`` and ``shared_id``
    share one directory, so a full fine-tuning job may span their machines."""
    device: str
    """``cuda:0,1,3`` (the GPUs it holds) or ``cpu``."""
    gpus: list[GpuOut]
    """Its pool: a job of N GPUs runs on N of them."""
    hardware: dict[str, Any]
    """What ``python -m trainer detect --json`` reported on the worker's device."""
    plan: PlanOut | None
    """The optimization plan the trainer would choose there (``hardware["plan"]`` when reported)."""
    trackers: dict[str, bool] | None = None
    """Which experiment trackers' packages import there (``mlflow``, ``tensorboard``, ``wandb``); null
    when it did not say (an older worker). A job asking for a tracker no live worker has is refused."""
    pool: dict[str, Any] | None = None
    """A Slurm bridge's pool (null for an ordinary worker): ``name``, ``partition``, ``nodes``,
    ``per_node`` (GPUs, or CPU slots when ``unit`` is ``cpu``), and ``cluster``, what Slurm reports
    now: ``nodes``/``cpus``/``gpus`` idle and allocated, and ftq's Slurm jobs with their state and
    pending reason (core/workers/pools.py)."""
    current_job: str | None
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float
    alive: bool
    """Heartbeat younger than FTQ_HEARTBEAT_TIMEOUT_S."""


class MachineGpuOut(GpuOut):
    """One GPU of a machine: which of its workers holds it in its pool."""

    worker: str


class MachineOut(BaseModel):
    """One machine: the workers that report the same hostname (and address)."""

    name: str
    """Its hostname."""
    address: str | None
    """Where other machines reach it; null when its workers did not say."""
    status: Literal["live", "lost"]
    """``lost``: no worker of it has beaten for longer than FTQ_HEARTBEAT_TIMEOUT_S; the reaper
    requeues (or fails) its running jobs once their own heartbeat is that old, freeing its GPUs."""
    heartbeat_at: dt.datetime
    """Its newest worker heartbeat."""
    heartbeat_age_s: float
    remote: bool
    """Its workers run with a worker key (another machine, no shared disk with the API)."""
    workers: list[str]
    """Ids of its workers (``data[].id``)."""
    gpus: list[MachineGpuOut]
    jobs: list[str]
    """The jobs holding its GPUs, in GPU order."""


class HardwareList(BaseModel):
    data: list[WorkerOut]
    """One row per worker host (unchanged for older clients)."""
    machines: list[MachineOut]
    """The same workers grouped by machine."""


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    checks: dict[str, str]
    """``ok`` or why the dependency is unreachable, for store, broker and (if configured) redis."""
