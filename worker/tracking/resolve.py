"""Which trackers a job gets: its spec's ``tracking`` over the box's settings.

    MLflow       spec.tracking.mlflow true, or null and a server is named (the spec's
                 mlflow_tracking_uri, else FTQ_MLFLOW_TRACKING_URI); false turns it off.
                 Experiment: the spec's, else FTQ_MLFLOW_EXPERIMENT (ftq).
    TensorBoard  spec.tracking.tensorboard true, or null and FTQ_TENSORBOARD_DIR is set; files in
                 FTQ_TENSORBOARD_DIR/<job id>, else <job dir>/tensorboard.

``mlflow: true`` with no server named anywhere is not refused at submission (the API cannot know
the worker host's settings): the job runs, and its events carry a warning naming what to set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from core.settings import Settings
from worker.tracking.dispatch import JobInfo, Tracker, Tracking


def trackers_for(spec: dict[str, Any], settings: Settings, *, job_id: str, output_dir: Path,
                 warn: Callable[[str], None]) -> list[Tracker]:
    """The trackers ``spec`` asks for on this box (an empty list: tracking is off)."""
    want = spec.get("tracking") or {}
    trackers: list[Tracker] = []
    uri = want.get("mlflow_tracking_uri") or settings.mlflow_tracking_uri
    if want.get("mlflow") is True or (want.get("mlflow") is None and uri):
        if uri:
            from worker.tracking.mlflow import MlflowTracker

            trackers.append(MlflowTracker(uri, want.get("mlflow_experiment") or settings.mlflow_experiment))
        else:
            warn("tracking.mlflow is true but no MLflow server is named: set tracking.mlflow_tracking_uri or "
                 "the box's FTQ_MLFLOW_TRACKING_URI; the job goes on without MLflow")
    if want.get("tensorboard") is True or (want.get("tensorboard") is None and settings.tensorboard_dir):
        from worker.tracking.tensorboard import TensorBoardTracker

        root = Path(settings.tensorboard_dir).expanduser() / job_id if settings.tensorboard_dir else output_dir / "tensorboard"
        trackers.append(TensorBoardTracker(root))
    return trackers


def start_tracking(spec: dict[str, Any], settings: Settings, job: JobInfo, *, output_dir: Path,
                   warn: Callable[[str], None]) -> Tracking:
    """A running ``Tracking`` for the job (a no-op one when nothing is configured)."""
    trackers = trackers_for(spec, settings, job_id=job.job_id, output_dir=output_dir, warn=warn)
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
        return start_tracking(info.spec, runtime.settings, info, output_dir=output_dir, warn=warn)
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
