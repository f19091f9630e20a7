"""Which trackers a job gets: its spec's ``tracking`` over the box's settings.

    MLflow       spec.tracking.mlflow true, or null and a server is named (the spec's
                 mlflow_server or mlflow_tracking_uri, else the box's default MLflow server);
                 false turns it off. Experiment: the spec's, else FTQ_MLFLOW_EXPERIMENT (ftq).
    TensorBoard  spec.tracking.tensorboard true, or null and FTQ_TENSORBOARD_DIR is set; files in
                 FTQ_TENSORBOARD_DIR/<job id>, else <job dir>/tensorboard.
    W&B          spec.tracking.wandb true, or null and a server or project is named (the spec's
                 wandb_server or wandb_project, else FTQ_WANDB_PROJECT); project: those, else ftq.
                 Entity, run name and tags from the spec; the server is the one the spec names,
                 else the box's default W&B server.

Servers come only from the box's allow-list as the job's project narrows it
(``core.jobs.trackers.allowed_trackers(settings, project)``, resolved by ``server_for`` as the API
resolved them at submission); a name or URL that is not on this worker's list for that project (a
job stored before the list, a project whose list a global admin narrowed since, or an API
configured differently) is a warning and that tracker is left out: nothing is sent to it. The
box's default servers turn a tracker on only for projects that may use them. Each server gets only the credential configured for it
(``credential_env``, read from this worker's environment here), never one of another server or the
ambient ``MLFLOW_TRACKING_TOKEN``/``WANDB_API_KEY``.

A tracker whose package this worker lacks (``installed``, which the worker also reports to the
store for the API's check at submission: ``core.jobs.trackers``) is left out with a warning
naming the field that asked for it and the command that installs it. ``mlflow: true`` with no
server named anywhere is not refused at submission: the job runs, and its events carry a warning
naming what to set.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from core.errors import InvalidInput
from core.jobs.trackers import (
    TRACKERS,
    allowed_trackers,
    asked_for,
    credential_variables,
    default_refusal,
    missing_message,
    server_for,
    withheld_default,
)
from core.settings import LEGACY_MLFLOW_SERVER, Settings, TrackingServer
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


def wanted(spec: dict[str, Any], settings: Settings,
           servers: Mapping[str, TrackingServer] | None = None) -> dict[str, str]:
    """Tracker → what turns it on for this job: a spec field (``tracking.wandb``) or a box
    setting (``FTQ_WANDB_PROJECT``); in ``TRACKERS`` order. ``servers``: the job's
    (``allowed_trackers(settings, project)``; None: the box's); a box setting turns a tracker on
    only where the job may use the box's default server of its kind."""
    want = spec.get("tracking") or {}
    asked = asked_for(want)
    servers = allowed_trackers(settings) if servers is None else servers
    default_mlflow = next((name for name, server in servers.items() if server.kind == "mlflow" and server.default), None)
    wandb_project = None if withheld_default("wandb", servers) else settings.wandb_project
    box = {"mlflow": ("FTQ_MLFLOW_TRACKING_URI" if default_mlflow == LEGACY_MLFLOW_SERVER else "FTQ_TRACKING_SERVERS",
                      default_mlflow),
           "tensorboard": ("FTQ_TENSORBOARD_DIR", settings.tensorboard_dir),
           "wandb": ("FTQ_WANDB_PROJECT", wandb_project)}
    for name, (variable, value) in box.items():
        if name not in asked and want.get(name) is None and value:
            asked[name] = variable
    return {name: asked[name] for name in TRACKERS if name in asked}


def trackers_for(spec: dict[str, Any], settings: Settings, *, job_id: str, output_dir: Path,
                 warn: Callable[[str], None], found: Mapping[str, bool] | None = None,
                 host: str | None = None, environ: Mapping[str, str] | None = None,
                 servers: Mapping[str, TrackingServer] | None = None) -> list[Tracker]:
    """The trackers ``spec`` asks for on this box (an empty list: tracking is off); ``found``:
    which packages import here (``installed()``), ``host``: this worker, for the warnings;
    ``environ``: where the servers' credentials are read (this process's environment);
    ``servers``: those the job's project may use (``allowed_trackers``; None: the box's)."""
    want = spec.get("tracking") or {}
    found = installed() if found is None else found
    servers = allowed_trackers(settings) if servers is None else servers
    environ = os.environ if environ is None else environ
    trackers: list[Tracker] = []
    for name, field in wanted(spec, settings, servers).items():
        if not found.get(name):
            warn(missing_message(name, field, host or socket.gethostname()))
            continue
        tracker = _BUILDERS[name](want, settings, job_id=job_id, output_dir=output_dir, warn=warn,
                                  servers=servers, environ=environ, field=field)
        if tracker is not None:
            trackers.append(tracker)
    return trackers


def _server(want: dict[str, Any], kind: str, servers: Mapping[str, TrackingServer],
            warn: Callable[[str], None], missing: str, field: str) -> tuple[str, TrackingServer] | None:
    """The listed server this job's ``kind`` tracker (turned on by ``field``) sends to, or None
    with a warning."""
    try:
        found = server_for(want, kind, servers)
    except InvalidInput as exc:
        warn(f"{exc.message}; nothing was sent to it, and the job goes on without {missing}")
        return None
    refusal = default_refusal(kind, field, servers) if found is None else None
    if refusal:
        warn(f"{refusal}; nothing was sent to it, and the job goes on without {missing}")
    elif found is None:
        warn(f"no {missing} server is named and the box marks none default: set tracking.{kind}_server, or mark "
             f"one of the box's FTQ_TRACKING_SERVERS default; the job goes on without {missing}")
    return found


def _credential(server: TrackingServer, environ: Mapping[str, str]) -> str | None:
    """The value of the worker's variable configured for ``server`` (None: none configured, or unset)."""
    return (environ.get(server.credential_env) or None) if server.credential_env else None


def _mlflow(want: dict[str, Any], settings: Settings, *, warn: Callable[[str], None],
            servers: Mapping[str, TrackingServer], environ: Mapping[str, str], field: str, **_: Any) -> Tracker | None:
    found = _server(want, "mlflow", servers, warn, "MLflow", field)
    if found is None:
        return None
    name, server = found
    from worker.tracking.mlflow import MlflowTracker

    assert server.url is not None, "an MLflow server has a URL (core.settings.TrackingServer)"
    return MlflowTracker(name, server.url, want.get("mlflow_experiment") or settings.mlflow_experiment,
                         token=_credential(server, environ), credential_env=server.credential_env)


def _tensorboard(want: dict[str, Any], settings: Settings, *, job_id: str, output_dir: Path, **_: Any) -> Tracker:
    from worker.tracking.tensorboard import TensorBoardTracker

    root = Path(settings.tensorboard_dir).expanduser() / job_id if settings.tensorboard_dir else output_dir / "tensorboard"
    return TensorBoardTracker(root)


def _wandb(want: dict[str, Any], settings: Settings, *, output_dir: Path, warn: Callable[[str], None],
           servers: Mapping[str, TrackingServer], environ: Mapping[str, str], field: str,
           **_: Any) -> Tracker | None:
    found = _server(want, "wandb", servers, warn, "W&B", field)
    if found is None:
        return None
    name, server = found
    from worker.tracking.wandb import WandbTracker

    return WandbTracker(project=want.get("wandb_project") or settings.wandb_project or "ftq",
                        entity=want.get("wandb_entity"), name=want.get("wandb_name"),
                        tags=tuple(want.get("wandb_tags") or ()), directory=output_dir, server=name,
                        base_url=server.url, api_key=_credential(server, environ),
                        credential_env=server.credential_env)


_BUILDERS: dict[str, Callable[..., Tracker | None]] = {"mlflow": _mlflow, "tensorboard": _tensorboard, "wandb": _wandb}


def start_tracking(spec: dict[str, Any], settings: Settings, job: JobInfo, *, output_dir: Path,
                   warn: Callable[[str], None], host: str | None = None,
                   servers: Mapping[str, TrackingServer] | None = None) -> Tracking:
    """A running ``Tracking`` for the job (a no-op one when nothing is configured); ``servers``:
    those the job's project may use (None: the box's)."""
    trackers = trackers_for(spec, settings, job_id=job.job_id, output_dir=output_dir, warn=warn, host=host,
                            servers=servers)
    return Tracking(trackers, job, warn)


def tracking_for(runtime: Any, job_id: str, output_dir: Path) -> Tracking:
    """The claimed job's ``Tracking`` (``runtime``: the worker's ``Runtime``): its spec and its
    project's tracking servers read from the store, its warnings written there as ``log`` events."""
    from core.jobs.models import Job
    from core.projects.models import Project
    from core.users.access import owner_name
    from trainer.training import layout

    warn = warning_writer(runtime, job_id)
    try:
        with runtime.sessionmaker() as session:
            job = session.get(Job, job_id)
            info = JobInfo(job_id=job_id, name=job.name, model=job.model, spec=dict(job.spec or {}),
                           owner=owner_name(session, job.owner_id), artifact_dir=layout.export_dir(output_dir, job.method))
            project = session.get(Project, job.project_id) if job.project_id is not None else None
            servers = allowed_trackers(runtime.settings, project)
        return start_tracking(info.spec, runtime.settings, info, output_dir=output_dir, warn=warn,
                              host=runtime.worker_id, servers=servers)
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


def without_credentials(env: Mapping[str, str], settings: Settings) -> dict[str, str]:
    """``env`` less every tracking credential the worker holds (``credential_variables``): what
    the trainer's environment starts from, since the worker, not the trainer, talks to trackers."""
    hidden = credential_variables(settings)
    return {name: value for name, value in env.items() if name not in hidden}
