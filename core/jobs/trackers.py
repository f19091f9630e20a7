"""Which experiment trackers a job asks for, and whether a live worker can run them.

A tracker runs in the worker process (``worker/tracking``), so it needs its Python package on the
worker host. Each worker reports which of them import there (``worker.tracking.resolve.installed``)
as ``"trackers": {"mlflow": true, "tensorboard": false, "wandb": true}`` in its ``worker.hardware``
row. ``check_trackers`` refuses, at submission, a job that asks for a tracker no live worker has,
naming the spec field and the command that installs it. When the API cannot know (no live worker,
or a live one that has not reported: an older worker, or one still starting) the job is accepted;
a worker without the package then says so in the job's events (``missing_message``), which the
job page shows as a banner, and the job runs without that tracker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.errors import Unsupported

TRACKERS = {"mlflow": "MLflow", "tensorboard": "TensorBoard", "wandb": "W&B"}
"""Each tracker, by its ``tracking`` field and Python package (the same name), and its name for people."""
INSTALL = ("install the 'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install 'ftq[tracking]' "
           "on the worker host, then restart the worker")
_NAMED_BY = {"mlflow": "mlflow_tracking_uri", "wandb": "wandb_project"}
"""With ``<tracker>: null``, naming this turns the tracker on."""


def asked_for(tracking: Mapping[str, Any]) -> dict[str, str]:
    """Tracker → the spec field that turns it on, for the trackers a job's ``tracking`` section
    asks for by itself (those the worker's box turns on are the box's business)."""
    asked = {}
    for name in TRACKERS:
        named_by = _NAMED_BY.get(name)
        if tracking.get(name) is True:
            asked[name] = f"tracking.{name}"
        elif tracking.get(name) is None and named_by and tracking.get(named_by):
            asked[name] = f"tracking.{named_by}"
    return asked


def check_trackers(tracking: Mapping[str, Any], reports: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse a tracker the job asks for that no live worker can import.

    Args:
        tracking: the spec's ``tracking`` section.
        reports: ``(worker id, its stored report)`` of each live worker.

    Raises:
        Unsupported: every live worker reported its trackers, and none has this one.
    """
    asked = asked_for(tracking)
    installed = {worker_id: report.get("trackers") for worker_id, report in reports}
    if not asked or not installed or not all(isinstance(found, dict) for found in installed.values()):
        return
    for name, field in asked.items():
        if any(found.get(name) is True for found in installed.values()):
            continue
        workers = ", ".join(sorted(installed))
        raise Unsupported(
            f"{field}: no live worker can run {TRACKERS[name]}: the {name} package is not installed on "
            f"{'worker' if len(installed) == 1 else 'workers'} {workers}. To track with it, {INSTALL}; "
            f"or set tracking.{name} to false",
            param=field,
        )


def missing_message(name: str, field: str, host: str) -> str:
    """The job event of a worker that was asked for ``name`` without its package."""
    return (f"{field}: the {name} package is not installed on worker {host}, so the job goes on without "
            f"{TRACKERS[name]}; to track with it, {INSTALL}")
