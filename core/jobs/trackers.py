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
it (``worker/tracking``), and the trainer it starts gets none of them (``credential_variables``).

A project may narrow the box's list (``Project.tracking_servers``; None: all of the box's):
``allowed_trackers(settings, project)`` is then that project's list, and the refusals name the
project and list what it may use. Where a job turns a tracker on without naming a server, the
box's default of that kind applies only to a project that may use it: a job asking for it anyway
is refused (``check_trackers``; the worker warns for a stored one), and the box's own turning on
(a default MLflow server, ``FTQ_WANDB_PROJECT``) skips that project's jobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from core.errors import InvalidInput, Unsupported
from core.settings import LEGACY_MLFLOW_SERVER, Settings, TrackingServer
from trainer.catalog import SERVER_TRACKERS, TRACKERS

if TYPE_CHECKING:
    from core.projects.models import Project

INSTALL = ("install the 'tracking' extra: make up SERVICE_EXTRAS=tracking, or pip install 'ftq[tracking]' "
           "on the worker host, then restart the worker")
_NAMED_BY = {"mlflow": ("mlflow_server", "mlflow_tracking_uri"), "wandb": ("wandb_server", "wandb_project")}
"""With ``<tracker>: null``, naming one of these turns the tracker on."""
KINDS = {kind: TRACKERS[kind] for kind in SERVER_TRACKERS}
"""The trackers that send to a server, by ``TrackingServer.kind``, and their names for people."""
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY")
"""The trackers' own credential variables, which their clients read wherever they send."""


class ServerList(dict[str, TrackingServer]):
    """The tracking servers a job may name, by name, and whose list it is: the box's
    (``project`` None), or a project's narrower one, with the box's servers it may not use
    (``withheld``) so a refusal can say why."""

    def __init__(self, servers: Mapping[str, TrackingServer], *, project: str | None = None,
                 withheld: Mapping[str, TrackingServer] | None = None) -> None:
        super().__init__(servers)
        self.project = project
        self.withheld = dict(withheld or {})


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


def allowed_trackers(settings: Settings, project: Project | None = None) -> ServerList:
    """The tracking servers jobs may name, by name: ``FTQ_TRACKING_SERVERS``, plus ``mlflow`` (the
    default) when ``FTQ_MLFLOW_TRACKING_URI`` is set, plus ``wandb`` (W&B as the worker's
    environment configures it: ``WANDB_BASE_URL`` and ``WANDB_API_KEY``, the default) when no W&B
    server is listed.

    ``project``: the job's project; its ``tracking_servers`` (None: all of the box's) keeps only
    the servers it names (a name the box no longer lists is skipped).
    """
    servers = dict(settings.tracking_servers)
    if settings.mlflow_tracking_uri:
        servers[LEGACY_MLFLOW_SERVER] = TrackingServer(kind="mlflow", url=settings.mlflow_tracking_uri,
                                                       credential_env="MLFLOW_TRACKING_TOKEN", default=True)
    if not any(server.kind == "wandb" for server in servers.values()):
        servers.setdefault("wandb", TrackingServer(kind="wandb", credential_env="WANDB_API_KEY", default=True))
    if project is None or project.tracking_servers is None:
        return ServerList(servers)
    allowed = set(project.tracking_servers)
    return ServerList({n: s for n, s in servers.items() if n in allowed}, project=project.name,
                      withheld={n: s for n, s in servers.items() if n not in allowed})


def credential_variables(settings: Settings) -> frozenset[str]:
    """Every environment variable of the worker that holds a tracking credential: the trackers'
    own (``CREDENTIAL_VARIABLES``) and each configured server's ``credential_env``. The trainer's
    environment goes without them: the worker, not the trainer, talks to trackers."""
    configured = {server.credential_env for server in allowed_trackers(settings).values() if server.credential_env}
    return frozenset(CREDENTIAL_VARIABLES) | configured


def server_for(tracking: Mapping[str, Any], kind: str,
               servers: Mapping[str, TrackingServer]) -> tuple[str, TrackingServer] | None:
    """The listed server a job's ``kind`` tracker sends to: the one ``tracking.<kind>_server``
    names, the MLflow server whose URL ``tracking.mlflow_tracking_uri`` is, else the default of
    that kind (None: there is none). Whether the tracker is on at all is ``asked_for``'s business.

    Raises:
        InvalidInput: a name or URL that is not a listed server of ``kind`` (or one the project
            may not use), or a name and a URL of two different servers; ``param`` is the field.
    """
    ours = _of_kind(kind, servers)
    field = f"{kind}_server"
    name = tracking.get(field)
    if name is not None and name not in ours:
        raise InvalidInput(f"tracking.{field}: {_not_ours(name, kind, servers)}; {_listed(kind, servers)}",
                           param=f"tracking.{field}")
    uri = tracking.get("mlflow_tracking_uri") if kind == "mlflow" else None
    if uri:
        by_url = [n for n, server in ours.items() if server.url == str(uri).rstrip("/")]
        if not by_url:
            raise InvalidInput(_unlisted_url(str(uri), servers), param="tracking.mlflow_tracking_uri")
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


def default_refusal(kind: str, field: str, servers: Mapping[str, TrackingServer]) -> str | None:
    """Why a job whose ``field`` turns the ``kind`` tracker on without naming a server may not
    have the box's default of that kind: ``servers`` is a project's list without it (None: it may)."""
    name = withheld_default(kind, servers)
    if name is None:
        return None
    assert isinstance(servers, ServerList)
    refusal = f"{field}: project {servers.project!r} may not use the box's default {KINDS[kind]} server {name!r}"
    if _of_kind(kind, servers):
        return (f"{refusal}, and the job names no other; name one with tracking.{kind}_server "
                f"({_listed(kind, servers)}), or set tracking.{kind} to false")
    return f"{refusal}; {_listed(kind, servers)}; set tracking.{kind} to false"


def withheld_default(kind: str, servers: Mapping[str, TrackingServer]) -> str | None:
    """The box's default ``kind`` server when ``servers`` is a project's list without it."""
    withheld = servers.withheld if isinstance(servers, ServerList) else {}
    return next((n for n, server in withheld.items() if server.kind == kind and server.default), None)


def _of_kind(kind: str, servers: Mapping[str, TrackingServer]) -> dict[str, TrackingServer]:
    return {name: server for name, server in servers.items() if server.kind == kind}


def _project(servers: Mapping[str, TrackingServer]) -> str | None:
    return servers.project if isinstance(servers, ServerList) else None


def _not_ours(name: str, kind: str, servers: Mapping[str, TrackingServer]) -> str:
    withheld = servers.withheld if isinstance(servers, ServerList) else {}
    if name in withheld and withheld[name].kind == kind:
        return f"project {_project(servers)!r} may not use the {KINDS[kind]} server {name!r}"
    return f"{name!r} is not {_a(kind)} server of this box"


def _unlisted_url(uri: str, servers: Mapping[str, TrackingServer]) -> str:
    withheld = servers.withheld if isinstance(servers, ServerList) else {}
    by_url = sorted(n for n, server in withheld.items() if server.kind == "mlflow" and server.url == uri.rstrip("/"))
    if by_url:
        return (f"tracking.mlflow_tracking_uri: this URL is the MLflow server {by_url[0]!r}, which project "
                f"{_project(servers)!r} may not use; {_listed('mlflow', servers)}")
    return ("tracking.mlflow_tracking_uri: jobs may send only to the tracking servers this box lists, and this "
            f"URL is none of them; name one with tracking.mlflow_server instead ({_listed('mlflow', servers)})")


def _a(kind: str) -> str:
    return "an MLflow" if kind == "mlflow" else "a W&B"


def _listed(kind: str, servers: Mapping[str, TrackingServer]) -> str:
    ours, project = _of_kind(kind, servers), _project(servers)
    if project is None:
        if not ours:
            return f"this box lists no {KINDS[kind]} server (FTQ_TRACKING_SERVERS)"
        return f"{KINDS[kind]} servers: {', '.join(sorted(ours))}"
    if not ours:
        return (f"project {project!r} may use no {KINDS[kind]} server (a global admin sets its list: "
                f"ftq projects set {project} --tracking-servers NAME,...)")
    return f"{KINDS[kind]} servers project {project!r} may use: {', '.join(sorted(ours))}"


def check_trackers(tracking: Mapping[str, Any], reports: list[tuple[str, dict[str, Any]]],
                   servers: Mapping[str, TrackingServer]) -> None:
    """Refuse a tracking server the box does not list (``check_servers``), and a tracker the job
    asks for that no live worker can import.

    Args:
        tracking: the spec's ``tracking`` section.
        reports: ``(worker id, its stored report)`` of each live worker.
        servers: the servers the job may name (``allowed_trackers``).

    Raises:
        InvalidInput: a server or URL that is not listed (``server_for``), or a tracker turned on
            without a server where the project may not use the box's default (``default_refusal``).
        Unsupported: every live worker reported its trackers, and none has this one.
    """
    check_servers(tracking, servers)
    asked = asked_for(tracking)
    for kind, field in asked.items():
        refusal = default_refusal(kind, field, servers) if kind in KINDS else None
        if refusal and server_for(tracking, kind, servers) is None:
            raise InvalidInput(refusal, param=field)
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
