from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow


class Worker(Base):
    """A worker host as it last reported itself: one Celery worker holding a pool of GPUs
    (``gpu_slot`` rows), or of CPU slots on a box without GPUs."""

    __tablename__ = "worker"

    worker_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(64))
    """``cuda:0,1,3``-style names of the GPUs the worker holds (as CUDA_VISIBLE_DEVICES names
    them), or ``cpu``."""
    hardware: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    """Output of ``python -m trainer detect --json`` (the hardware and the plan on it), plus
    ``trackers``: which experiment trackers' packages import in the worker's Python
    (``{"mlflow": true, "tensorboard": true, "wandb": false}``; ``core.jobs.trackers``)."""
    current_job_id: Mapped[str | None] = mapped_column(String(40))
    """The job this worker claimed last while it runs (the ``gpu_slot`` rows say which jobs hold
    which GPUs)."""
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    key_id: Mapped[str | None] = mapped_column(
        ForeignKey("worker_key.worker_key_id", ondelete="SET NULL"), index=True
    )
    """The worker key a remote worker runs with (``core.workers.keys``); None for a local worker
    sharing the API's data directory."""
    address: Mapped[str | None] = mapped_column(String(255))
    """The address other machines reach this worker at (torchrun's rendezvous)."""
    pool: Mapped[str | None] = mapped_column(String(64))
    """The named pool this host serves (a Slurm bridge's, docs/slurm.md): only jobs naming it
    land here, and none of them anywhere else; None: an ordinary worker host."""
    shared_dir: Mapped[str | None] = mapped_column(String(1024))
    """The shared checkpoint directory this machine mounts (``FTQ_SHARED_DIR``); None: none."""
    shared_id: Mapped[str | None] = mapped_column(String(64))
    """The id in that directory's marker file (worker/shared_storage.py): workers with the same
    ``shared_id`` and ``shared_dir`` see one directory at one path."""


class GpuSlot(Base):
    """One GPU of a worker host's pool (a CPU slot on a box without GPUs), and the job holding it.

    A job holds all the GPUs it needs on one host, reserved in the claim's transaction and
    released in the one that ends its run (``core.jobs.scheduling``); ``job_id`` is None when free.
    """

    __tablename__ = "gpu_slot"

    worker_id: Mapped[str] = mapped_column(ForeignKey("worker.worker_id", ondelete="CASCADE"), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    """0-based position in the worker's pool."""
    device: Mapped[str | None] = mapped_column(String(64))
    """The GPU as ``CUDA_VISIBLE_DEVICES`` names it (an index or a UUID); None for a CPU slot."""
    job_id: Mapped[str | None] = mapped_column(ForeignKey("job.job_id", ondelete="SET NULL"), index=True)
    reserved_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)


class WorkerKey(Base):
    """A worker key: lets a worker on another machine use the ``/v1/worker/`` routes, and nothing
    else. Stored hashed like users' keys (``core.users.models.ApiKey``): only ``prefix`` (for
    lookup) and the SHA-256 of the whole ``ftqw_<prefix>_<secret>`` key."""

    __tablename__ = "worker_key"

    worker_key_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str | None] = mapped_column(ForeignKey("user.user_id", ondelete="SET NULL"))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
