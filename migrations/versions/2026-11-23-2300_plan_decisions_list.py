"""plan events as one decisions list: a data migration, no schema change.

The trainer's plan used to carry its kernel choices as flat pairs beside the switch decisions
(``attention_backend``/``attention_reason``, ``loss_kernel``/``loss_reason``, ``lora_kernel``/
``lora_reason``, ``fused_ops``/``fused_ops_reason``). Now every choice is one entry of
``decisions``, ``{name, requested, enabled, backend, reason}``: the kernel choices ``attention``,
``loss``, ``lora_kernel``, ``fused_ops`` first, then the switches. Rewrites the plans already
stored so every reader sees one shape: ``job.plan``, the ``plan`` events in ``job_event.data``
(what the SSE history replays) and the ``plan`` of each ``worker.hardware`` report.
``requested`` is the job's value for a switch (``auto`` where its spec has none, and for the
kernel choices and a worker's report). The downgrade writes the flat pairs back.

Revision ID: 5d1c0b7e9a42
Revises: 8fcce2782fb5
Create Date: 2026-11-23 23:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '5d1c0b7e9a42'
down_revision: str | Sequence[str] | None = '8fcce2782fb5'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# decision name -> (flat backend key, flat reason key)
KERNELS = {
    "attention": ("attention_backend", "attention_reason"),
    "loss": ("loss_kernel", "loss_reason"),
    "lora_kernel": ("lora_kernel", "lora_reason"),
    "fused_ops": ("fused_ops", "fused_ops_reason"),
}
FLAT_KEYS = frozenset(key for pair in KERNELS.values() for key in pair)

_job = sa.table("job", sa.column("job_id", sa.String), sa.column("plan", core.db.JSONType),
                sa.column("spec", core.db.JSONType))
_event = sa.table("job_event", sa.column("job_event_id", sa.BigInteger), sa.column("job_id", sa.String),
                  sa.column("type", sa.String), sa.column("data", core.db.JSONType))
_worker = sa.table("worker", sa.column("worker_id", sa.String), sa.column("hardware", core.db.JSONType))

Convert = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]


def to_decisions(plan: dict[str, Any], requested: dict[str, Any]) -> dict[str, Any] | None:
    """The plan with its flat kernel pairs moved into ``decisions``; None when there were none."""
    if not FLAT_KEYS & plan.keys():
        return None
    kernels = []
    for name, (backend_key, reason_key) in KERNELS.items():
        if backend_key not in plan and reason_key not in plan:
            continue  # a plan recorded before the trainer chose this kernel
        backend = plan.get(backend_key)
        enabled = {"lora_kernel": backend == "ftq_fused_lora", "fused_ops": bool(backend)}.get(name, True)
        kernels.append({"name": name, "requested": "auto", "enabled": enabled, "backend": backend,
                        "reason": plan.get(reason_key) or ""})
    switches = [
        {**d, "requested": d.get("requested") or requested.get(d.get("name"), "auto")}
        for d in plan.get("decisions") or []
        if isinstance(d, dict)
    ]
    converted = {key: value for key, value in plan.items() if key not in FLAT_KEYS}
    converted["decisions"] = kernels + switches
    return converted


def to_flat(plan: dict[str, Any], requested: dict[str, Any]) -> dict[str, Any] | None:
    """The plan as it was before: kernel choices as flat pairs, switch decisions without requested."""
    decisions = [d for d in plan.get("decisions") or [] if isinstance(d, dict)]
    if not any("requested" in d or d.get("name") in KERNELS for d in decisions):
        return None
    flat = {key: value for key, value in plan.items() if key != "decisions"}
    for d in decisions:
        if d.get("name") in KERNELS:
            backend_key, reason_key = KERNELS[d["name"]]
            flat[backend_key], flat[reason_key] = d.get("backend"), d.get("reason", "")
    flat["decisions"] = [
        {key: value for key, value in d.items() if key != "requested"}
        for d in decisions
        if d.get("name") not in KERNELS
    ]
    return flat


def _rewrite(convert: Convert) -> None:
    conn = op.get_bind()
    for job_id, plan, spec in conn.execute(sa.select(_job.c.job_id, _job.c.plan, _job.c.spec)).all():
        new = convert(plan, _requested(spec)) if isinstance(plan, dict) else None
        if new is not None:
            conn.execute(_job.update().where(_job.c.job_id == job_id).values(plan=new))
    events = sa.select(_event.c.job_event_id, _event.c.data, _job.c.spec).join(
        _job, _job.c.job_id == _event.c.job_id).where(_event.c.type == "plan")
    for event_id, data, spec in conn.execute(events).all():
        new = convert(data, _requested(spec)) if isinstance(data, dict) else None
        if new is not None:
            conn.execute(_event.update().where(_event.c.job_event_id == event_id).values(data=new))
    for worker_id, hardware in conn.execute(sa.select(_worker.c.worker_id, _worker.c.hardware)).all():
        plan = hardware.get("plan") if isinstance(hardware, dict) else None
        new = convert(plan, {}) if isinstance(plan, dict) else None
        if new is not None:
            conn.execute(_worker.update().where(_worker.c.worker_id == worker_id).values(
                hardware={**hardware, "plan": new}))


def _requested(spec: Any) -> dict[str, Any]:
    optimizations = spec.get("optimizations") if isinstance(spec, dict) else None
    return optimizations if isinstance(optimizations, dict) else {}


def upgrade() -> None:
    _rewrite(to_decisions)


def downgrade() -> None:
    _rewrite(to_flat)
