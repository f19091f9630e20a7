"""Named pools: hosts that stand for a cluster scheduler's machines (a Slurm bridge), and the
limits they publish.

A bridge registers as one worker host with ``worker.pool`` set (``slurm``) and slots for the
whole partition (nodes x GPUs per node, or CPU task slots on a cluster without GPUs). In
``worker.hardware`` it keeps the partition's shape and what the cluster reports now, refreshed
at every heartbeat (``POOL_KEY``)::

    {"pool": {"kind": "slurm", "name": "slurm", "partition": "gpu", "nodes": 4, "per_node": 8,
              "unit": "gpu", "account": ..., "qos": ...,
              "cluster": {"nodes": {"idle": 2, "allocated": 1, "other": 1},
                          "cpus": {"idle": .., "allocated": .., "total": ..},
                          "gpus": {"idle": .., "allocated": .., "total": ..},
                          "jobs": [{"job_id": "job-..", "slurm_job_id": "123", "state": "PENDING",
                                    "reason": "Resources"}]},
              "observed_at": "2026-..."}}

``check_pool`` refuses at submission what the partition can never run (more nodes than it
has, more GPUs per node than its nodes have) and a pool no bridge ever served: a job there
would wait forever.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import Unsupported
from core.workers.models import Worker

POOL_KEY = "pool"
"""The key of a bridge's report in ``worker.hardware``."""


def pool_report(hardware: dict[str, Any] | None) -> dict[str, Any] | None:
    """The pool part of a worker's hardware report (None: an ordinary host)."""
    report = (hardware or {}).get(POOL_KEY)
    return report if isinstance(report, dict) else None


def latest_report(session: Session, name: str) -> tuple[Worker, dict[str, Any]] | None:
    """The bridge of pool ``name`` that beat last, with its report; None: none ever registered."""
    rows = session.scalars(select(Worker).where(Worker.pool == name).order_by(Worker.heartbeat_at.desc()))
    for row in rows:
        report = pool_report(row.hardware)
        if report is not None:
            return row, report
    return None


def check_pool(session: Session, name: str, *, gpus: int, nodes: int) -> None:
    """Refuse a job of ``gpus`` over ``nodes`` that pool ``name`` can never run.

    A bridge that is down now (stale heartbeat) still bounds the job by the partition it last
    reported: the job waits for it, as a job waits for an ordinary worker host.

    Raises:
        Unsupported: no bridge ever served the pool (``pool``), more nodes than the partition has
            (``nodes``), or more GPUs per node than its nodes have (``gpus``).
    """
    found = latest_report(session, name)
    if found is None:
        known = sorted({p for p in session.scalars(select(Worker.pool).where(Worker.pool.is_not(None)))})
        listed = f" (pools known: {', '.join(known)})" if known else " (no pool is known)"
        raise Unsupported(f"pool: no bridge serves pool {name!r}{listed}; start one where sbatch works "
                          "(`ftq slurm-bridge`, docs/slurm.md) or leave pool unset", param="pool")
    worker, report = found
    partition = report.get("partition", "?")
    size, per_node = int(report.get("nodes", 0)), int(report.get("per_node", 0))
    unit = "GPU" if report.get("unit") == "gpu" else "CPU slot"
    if nodes > size:
        raise Unsupported(f"nodes: {nodes} is more than Slurm partition {partition!r} of pool {name!r} has "
                          f"({size} node{'s' if size != 1 else ''}); set nodes to at most {size}", param="nodes")
    if gpus // nodes > per_node:
        raise Unsupported(f"gpus: {gpus} over {nodes} node{'s' if nodes != 1 else ''} is {gpus // nodes} per node, "
                          f"more than the nodes of Slurm partition {partition!r} (pool {name!r}) have: {per_node} "
                          f"{unit}{'s' if per_node != 1 else ''} each; set gpus to at most {per_node * nodes} or "
                          "spread it over more nodes", param="gpus")
