"""Which experiment trackers a job asks for, and whether a live worker can run them.

A tracker runs in the worker process (``worker/tracking``), so it needs its Python package on the
worker host. Each worker reports which of them import there (``worker.tracking.resolve.installed``)
as ``"trackers": {"mlflow": true, "tensorboard": false, "wandb": true}`` in its ``worker.hardware``
row. ``check_trackers`` refuses, at submission, a job that asks for a tracker no live worker has,
naming the spec field and the command that installs it. When the API cannot know (no live worker,
or a live one that has not reported: an older worker, or one still starting) the job is accepted;
a worker without the package then says so in the job's events (``missing_message``), which the
job page shows as a banner, and the job runs without that tracker.

Where a tracker sends (issue 23 item 3): MLflow and W&B servers are an allow-list the operator
configures (``FTQ_TRACKING_SERVERS``; ``allowed_trackers``); a job names one by name
(``tracking.mlflow_server``, ``tracking.wandb_server``) or gets the default of its kind. The older
``tracking.mlflow_tracking_uri`` is taken only when it is a listed MLflow server's URL (and then
means that server). ``server_for`` is the one resolution: the API refuses at submission
(``check_servers``) what the worker would refuse at run time, where it becomes a warning and the
job runs without that tracker. The worker sends each server only the credential configured for
it (``worker/tracking``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.errors import InvalidInput, Unsupported
from core.settings import LEGACY_MLFLOW_SERVER, Settings, TrackingServer

TRACKERS = {"mlflow": "MLflow", "tensorboard": "TensorBoard", "wandb": "W&B"}
"""Each tracker, by its ``tracking`` field and Python package (the same name), and its name for people."""
INSTALL = ("install the 'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install 'ftq[tracking]' "
           "on the worker host, then restart the worker")
_NAMED_BY = {"mlflow": ("mlflow_server", "mlflow_tracking_uri"), "wandb": ("wandb_server", "wandb_project")}
"""With ``<tracker>: null``, naming one of these turns the tracker on."""
KINDS = {"mlflow": "MLflow", "wandb": "W&B"}
"""The trackers that send to a server, by ``TrackingServer.kind``."""


def asked_for(tracking: Mapping[str, Any]) -> dict[str, str]:
    """Tracker → the spec field that turns it on, for the trackers a job's ``tracking`` section
    asks for by itself (those the worker's box turns on are the box's business)."""
    asked = {}
    for name in TRACKERS:
        named_by = [field for field in _NAMED_BY.get(name, ()) if tracking.get(field)]
        if tracking.get(name) is True:
            asked[name] = f"tracking.{name}"
        elif tracking.get(name) is None and named_by:
            asked[name] = f"tracking.{named_by[0]}"
    return asked


def allowed_trackers(settings: Settings, project: str | None = None) -> dict[str, TrackingServer]:
    """The tracking servers jobs may name, by name: ``FTQ_TRACKING_SERVERS``, plus ``mlflow`` (the
    default) when ``FTQ_MLFLOW_TRACKING_URI`` is set, plus ``wandb`` (W&B as the worker's
    environment configures it: ``WANDB_BASE_URL`` and ``WANDB_API_KEY``, the default) when no W&B
    server is listed.

    ``project``: the job's project, for per-project allow-lists (none yet: every project gets the
    box's list).
    """
    servers = dict(settings.tracking_servers)
    if settings.mlflow_tracking_uri:
        servers[LEGACY_MLFLOW_SERVER] = TrackingServer(kind="mlflow", url=settings.mlflow_tracking_uri,
                                                       credential_env="MLFLOW_TRACKING_TOKEN", default=True)
    if not any(server.kind == "wandb" for server in servers.values()):
        servers.setdefault("wandb", TrackingServer(kind="wandb", credential_env="WANDB_API_KEY", default=True))
    return servers


def server_for(tracking: Mapping[str, Any], kind: str,
               servers: Mapping[str, TrackingServer]) -> tuple[str, TrackingServer] | None:
    """The listed server a job's ``kind`` tracker sends to: the one ``tracking.<kind>_server``
    names, the MLflow server whose URL ``tracking.mlflow_tracking_uri`` is, else the default of
    that kind (None: there is none). Whether the tracker is on at all is ``asked_for``'s business.

    Raises:
        InvalidInput: a name or URL that is not a listed server of ``kind``, or a name and a URL
            of two different servers; ``param`` is the field.
    """
    ours = {name: server for name, server in servers.items() if server.kind == kind}
    field = f"{kind}_server"
    name = tracking.get(field)
    if name is not None and name not in ours:
        raise InvalidInput(f"tracking.{field}: {name!r} is not {_a(kind)} server of this box; {_listed(kind, ours)}",
                           param=f"tracking.{field}")
    uri = tracking.get("mlflow_tracking_uri") if kind == "mlflow" else None
    if uri:
        by_url = [n for n, server in ours.items() if server.url == str(uri).rstrip("/")]
        if not by_url:
            raise InvalidInput(
                "tracking.mlflow_tracking_uri: jobs may send only to the tracking servers this box lists, "
                f"and this URL is none of them; name one with tracking.mlflow_server instead ({_listed(kind, ours)})",
                param="tracking.mlflow_tracking_uri")
        if name is not None and name not in by_url:
            raise InvalidInput(f"tracking.mlflow_tracking_uri is not the URL of tracking.mlflow_server {name!r}; "
                               "remove tracking.mlflow_tracking_uri", param="tracking.mlflow_tracking_uri")
        name = name or by_url[0]
    if name is None:
        name = next((n for n, server in ours.items() if server.default), None)
    return None if name is None else (name, ours[name])


def check_servers(tracking: Mapping[str, Any], servers: Mapping[str, TrackingServer]) -> None:
    """Refuse, at submission, a tracking server or URL the job names that ``servers`` does not list
    (whether or not the tracker is on: nothing unlisted is stored to be sent to later).

    Raises:
        InvalidInput: as ``server_for``.
    """
    for kind in KINDS:
        server_for(tracking, kind, servers)


def _a(kind: str) -> str:
    return "an MLflow" if kind == "mlflow" else "a W&B"


def _listed(kind: str, ours: Mapping[str, TrackingServer]) -> str:
    if not ours:
        return f"this box lists no {KINDS[kind]} server (FTQ_TRACKING_SERVERS)"
    return f"{KINDS[kind]} servers: {', '.join(sorted(ours))}"


def check_trackers(tracking: Mapping[str, Any], reports: list[tuple[str, dict[str, Any]]],
                   servers: Mapping[str, TrackingServer]) -> None:
    """Refuse a tracking server the box does not list (``check_servers``), and a tracker the job
    asks for that no live worker can import.

    Args:
        tracking: the spec's ``tracking`` section.
        reports: ``(worker id, its stored report)`` of each live worker.
        servers: the servers the job may name (``allowed_trackers``).

    Raises:
        InvalidInput: a server or URL that is not listed (``server_for``).
        Unsupported: every live worker reported its trackers, and none has this one.
    """
    check_servers(tracking, servers)
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
