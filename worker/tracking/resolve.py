"""Which trackers a job gets: its spec's ``tracking`` over the box's settings.

    MLflow       spec.tracking.mlflow true, or null and a server is named (the spec's
                 mlflow_tracking_uri, else FTQ_MLFLOW_TRACKING_URI); false turns it off.
                 Experiment: the spec's, else FTQ_MLFLOW_EXPERIMENT (ftq).
    TensorBoard  spec.tracking.tensorboard true, or null and FTQ_TENSORBOARD_DIR is set; files in
                 FTQ_TENSORBOARD_DIR/<job id>, else <job dir>/tensorboard.
    W&B          spec.tracking.wandb true, or null and a project is named (the spec's
                 wandb_project, else FTQ_WANDB_PROJECT); project: those, else ftq. Entity, run
                 name and tags from the spec; the key and server from the worker's environment.

A tracker whose package this worker lacks (``installed``, which the worker also reports to the
store for the API's check at submission: ``core.jobs.trackers``) is left out with a warning
naming the field that asked for it and the command that installs it. ``mlflow: true`` with no
server named anywhere is not refused at submission (the API cannot know the worker host's
settings): the job runs, and its events carry a warning naming what to set.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from core.jobs.trackers import TRACKERS, asked_for, missing_message
from core.settings import Settings
from worker.tracking.dispatch import JobInfo, Tracker, Tracking


def installed() -> dict[str, bool]:
    """Which trackers' packages this Python can import (found by ``importlib``, not imported)."""
    found = {}
    for name in TRACKERS:
        try:
            found[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found[name] = False
    return found


def wanted(spec: dict[str, Any], settings: Settings) -> dict[str, str]:
    """Tracker → what turns it on for this job: a spec field (``tracking.wandb``) or a box
    setting (``FTQ_WANDB_PROJECT``); in ``TRACKERS`` order."""
    want = spec.get("tracking") or {}
    asked = asked_for(want)
    box = {"mlflow": ("FTQ_MLFLOW_TRACKING_URI", settings.mlflow_tracking_uri),
           "tensorboard": ("FTQ_TENSORBOARD_DIR", settings.tensorboard_dir),
           "wandb": ("FTQ_WANDB_PROJECT", settings.wandb_project)}
    for name, (variable, value) in box.items():
        if name not in asked and want.get(name) is None and value:
            asked[name] = variable
    return {name: asked[name] for name in TRACKERS if name in asked}


def trackers_for(spec: dict[str, Any], settings: Settings, *, job_id: str, output_dir: Path,
                 warn: Callable[[str], None], found: Mapping[str, bool] | None = None,
                 host: str | None = None) -> list[Tracker]:
    """The trackers ``spec`` asks for on this box (an empty list: tracking is off); ``found``:
    which packages import here (``installed()``), ``host``: this worker, for the warnings."""
    want = spec.get("tracking") or {}
    found = installed() if found is None else found
    trackers: list[Tracker] = []
    for name, field in wanted(spec, settings).items():
        if not found.get(name):
            warn(missing_message(name, field, host or socket.gethostname()))
            continue
        tracker = _BUILDERS[name](want, settings, job_id=job_id, output_dir=output_dir, warn=warn)
        if tracker is not None:
            trackers.append(tracker)
    return trackers


def _mlflow(want: dict[str, Any], settings: Settings, *, warn: Callable[[str], None], **_: Any) -> Tracker | None:
    uri = want.get("mlflow_tracking_uri") or settings.mlflow_tracking_uri
    if not uri:
        warn("tracking.mlflow is true but no MLflow server is named: set tracking.mlflow_tracking_uri or "
             "the box's FTQ_MLFLOW_TRACKING_URI; the job goes on without MLflow")
        return None
    from worker.tracking.mlflow import MlflowTracker

    return MlflowTracker(uri, want.get("mlflow_experiment") or settings.mlflow_experiment)


def _tensorboard(want: dict[str, Any], settings: Settings, *, job_id: str, output_dir: Path, **_: Any) -> Tracker:
    from worker.tracking.tensorboard import TensorBoardTracker

    root = Path(settings.tensorboard_dir).expanduser() / job_id if settings.tensorboard_dir else output_dir / "tensorboard"
    return TensorBoardTracker(root)


def _wandb(want: dict[str, Any], settings: Settings, *, output_dir: Path, **_: Any) -> Tracker:
    from worker.tracking.wandb import WandbTracker

    return WandbTracker(project=want.get("wandb_project") or settings.wandb_project or "ftq",
                        entity=want.get("wandb_entity"), name=want.get("wandb_name"),
                        tags=tuple(want.get("wandb_tags") or ()), directory=output_dir)


_BUILDERS: dict[str, Callable[..., Tracker | None]] = {"mlflow": _mlflow, "tensorboard": _tensorboard, "wandb": _wandb}


def start_tracking(spec: dict[str, Any], settings: Settings, job: JobInfo, *, output_dir: Path,
                   warn: Callable[[str], None], host: str | None = None) -> Tracking:
    """A running ``Tracking`` for the job (a no-op one when nothing is configured)."""
    trackers = trackers_for(spec, settings, job_id=job.job_id, output_dir=output_dir, warn=warn, host=host)
    return Tracking(trackers, job, warn)


def tracking_for(runtime: Any, job_id: str, output_dir: Path) -> Tracking:
    """The claimed job's ``Tracking`` (``runtime``: the worker's ``Runtime``): its spec read from
    the store, its warnings written there as ``log`` events."""
    from core.jobs.models import Job
    from core.users.access import owner_name
    from trainer import layout

    warn = warning_writer(runtime, job_id)
    try:
        with runtime.sessionmaker() as session:
            job = session.get(Job, job_id)
            info = JobInfo(job_id=job_id, name=job.name, model=job.model, spec=dict(job.spec or {}),
                           owner=owner_name(session, job.owner_id), artifact_dir=layout.export_dir(output_dir, job.method))
        return start_tracking(info.spec, runtime.settings, info, output_dir=output_dir, warn=warn,
                              host=runtime.worker_id)
    except Exception as exc:  # noqa: BLE001 - tracking must never fail a job, even by its own bug
        warn(f"tracking could not start ({exc!r}); the job goes on without it")
        return Tracking([], JobInfo(job_id=job_id, name=None, model=""), warn)


def warning_writer(runtime: Any, job_id: str) -> Callable[[str], None]:
    """A ``warn`` that appends ``{"type": "log", "level": "warning"}`` to the job's events in its own
    transaction and wakes live viewers; a store that refuses it is logged, nothing more."""
    import logging

    from core.jobs.service import append_events

    def warn(message: str) -> None:
        try:
            with runtime.sessionmaker.begin() as session:
                (event,) = append_events(session, job_id, [("log", {"level": "warning", "message": message,
                                                                    "source": "tracking"})])
                seq = event.seq
            runtime.publish(job_id, seq)
        except Exception as exc:  # noqa: BLE001 - a warning about tracking must not fail anything either
            logging.getLogger(__name__).warning("job %s: tracking warning not stored (%s): %s", job_id, exc, message)

    return warn
