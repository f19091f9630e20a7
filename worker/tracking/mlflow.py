"""MLflow: one run per job run in an experiment; the spec as params, step and eval metrics by step,
the adapter (or the full model) as the run's ``adapter`` artifact, the run ended with the job's state.

Metric keys: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/mfu``
... (``STEP_METRICS``: the step event's numeric fields, every objective's included, e.g.
``train/token_accuracy``, ``train/reward_margin``) and ``eval/loss``. Params are the stored spec flattened
with dots (``hyperparameters.learning_rate``), plus ``job_id`` and ``model``; the run carries the tags
``ftq.job_id`` and ``ftq.owner``.

The worker speaks MLflow's REST API itself (``/api/2.0/mlflow/...``; the adapter through the
server's proxied artifact store, ``/api/2.0/mlflow-artifacts/...``) rather than through MLflow's
client, which adds credentials from the worker's environment (``MLFLOW_TRACKING_TOKEN``,
``MLFLOW_TRACKING_USERNAME``, ``~/.mlflow/credentials``) to every server it talks to. Here a server
gets exactly the token configured for it (``token``) or none, redirects are not followed, and a
failure is ftq's message (the HTTP status and the call), never the server's answer. Each request
gives up after 10 s (one retry of a failed connection), so a down server costs a warning within
seconds. An artifact store the server does not proxy (``s3://``, ``gs://`` ...) is written with
MLflow's own artifact client and that store's credentials, as MLflow would.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from trainer import objectives
from worker.tracking.dispatch import JobInfo, TrackerFailure

STEP_METRICS = ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms", "mfu", "epoch", "gpu_mem_peak",
                "gpu_alloc_retries", *objectives.metric_names())
"""The step fields sent as ``train/<name>``: the run's, then each objective's (``trainer.objectives``;
null ones, another objective's, are skipped)."""
END_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "queued": "KILLED", "lost": "KILLED"}
"""A job handed back (``queued``) or lost to another worker ends its run as KILLED; its next attempt is a new run."""
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
API = "/api/2.0/mlflow/"
ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts/"
TIMEOUT_S = 10.0
_LOCAL_STORES = ("", "file")
"""Artifact locations on the server's own disk: nothing the worker can write to."""


def flatten(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"lora": {"r": 16}}`` → ``{"lora.r": "16"}`` (lists as JSON-ish text, None as ``None``)."""
    out: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)[:6000]
    return out


class MlflowTracker:
    def __init__(self, server: str, url: str, experiment: str, *, token: str | None = None,
                 credential_env: str | None = None, timeout_s: float = TIMEOUT_S) -> None:
        """``server``: its name in the box's list; ``token``: the credential configured for it
        (sent as ``Authorization: Bearer``), read from the worker's ``credential_env``."""
        self.server = server
        self.url = url.rstrip("/")
        self.experiment = experiment
        self.label = f"MLflow server {server}"
        self.run_id: str | None = None
        self._artifact_uri = ""
        self._token = token
        self._credential_env = credential_env
        self._timeout_s = timeout_s
        self._http: httpx.Client | None = None

    def start(self, job: JobInfo) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self._timeout_s,
                                  follow_redirects=False, transport=httpx.HTTPTransport(retries=1))
        experiment_id = self._experiment_id()
        tags = [{"key": "ftq.job_id", "value": job.job_id}, {"key": "ftq.owner", "value": job.owner or ""}]
        run = self._call("POST", "runs/create", json={
            "experiment_id": experiment_id, "run_name": job.name or job.job_id,
            "start_time": int(time.time() * 1000), "tags": tags})
        info = _field(run, "runs/create", "run", "info")
        self.run_id = str(_field(info, "runs/create", "run_id"))
        self._artifact_uri = str(info.get("artifact_uri") or "")
        params = [{"key": k, "value": v} for k, v in {**flatten(job.spec), "job_id": job.job_id,
                                                         "model": job.model}.items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self._call("POST", "runs/log-batch", json={"run_id": self.run_id,
                                                       "params": params[i : i + _PARAMS_PER_BATCH]})

    def log(self, events: list[dict[str, Any]]) -> None:
        metrics = [{"key": key, "value": value, "timestamp": ts, "step": step}
                   for key, value, ts, step in metric_points(events)]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self._call("POST", "runs/log-batch", json={"run_id": self.run_id,
                                                       "metrics": metrics[i : i + _METRICS_PER_BATCH]})

    def finish(self, status: str, artifact_dir: Path | None) -> None:
        try:
            if artifact_dir is not None and Path(artifact_dir).is_dir():
                self._upload(Path(artifact_dir))
            self._call("POST", "runs/update", json={"run_id": self.run_id, "status": END_STATUS.get(status, "FAILED"),
                                                    "end_time": int(time.time() * 1000)})
        finally:
            if self._http is not None:
                self._http.close()

    def _experiment_id(self) -> str:
        for _ in range(2):  # another job may create it between our lookup and our create
            found = self._call("GET", "experiments/get-by-name", params={"experiment_name": self.experiment},
                               absent=404)
            if found is not None:
                return str(_field(found, "experiments/get-by-name", "experiment", "experiment_id"))
            created = self._call("POST", "experiments/create", json={"name": self.experiment}, absent=400)
            if created is not None:
                return str(_field(created, "experiments/create", "experiment_id"))
        raise TrackerFailure(f"experiment {self.experiment!r} could be neither found nor created")

    def _call(self, method: str, call: str, *, absent: int | None = None, **request: Any) -> Any:
        """One REST call's JSON answer; None for the status ``absent`` means (not found, exists)."""
        assert self._http is not None, "start() opens the connection"
        response = self._http.request(method, API + call, **request)
        if response.status_code == absent:
            return None
        self._check(response, call)
        try:
            return response.json()
        except ValueError:
            raise TrackerFailure(f"the answer to {call} is not JSON") from None

    def _check(self, response: httpx.Response, call: str) -> None:
        status = response.status_code
        if status == 200:
            return
        hint = ""
        if status in (401, 403):
            hint = (f": check the credential configured for it ({self._credential_env} on the worker)"
                    if self._credential_env else ": it is configured without a credential (credential_env)")
        elif 300 <= status < 400:
            hint = ": redirects are not followed; list the URL it redirects to"
        raise TrackerFailure(f"HTTP {status} from {call}{hint}")

    def _upload(self, directory: Path) -> None:
        """The adapter's files as the run's ``adapter/`` artifacts."""
        location = urlsplit(self._artifact_uri)
        if location.scheme not in ("mlflow-artifacts", "http", "https", *_LOCAL_STORES):
            return _upload_with_mlflow(self._artifact_uri, directory)
        base = self._artifact_path(location)
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not path.is_symlink():
                target = f"{ARTIFACTS}{quote(base)}/adapter/{quote(path.relative_to(directory).as_posix())}"
                with path.open("rb") as body:
                    assert self._http is not None
                    self._check(self._http.put(target, content=body), "mlflow-artifacts upload")

    def _artifact_path(self, location: Any) -> str:
        """Where in the server's proxied store the run's artifacts are; only this server's."""
        own = urlsplit(self.url)
        if location.scheme in _LOCAL_STORES:
            raise TrackerFailure("the server's artifact store is a path on its own disk, which the worker cannot "
                                 "write to; the adapter was not uploaded (start it with --serve-artifacts)")
        if location.scheme == "mlflow-artifacts" and location.netloc in ("", own.netloc):
            return location.path.strip("/")
        prefix = f"{own.path.rstrip('/')}{ARTIFACTS}"
        if (location.scheme, location.netloc) == (own.scheme, own.netloc) and location.path.startswith(prefix):
            return location.path[len(prefix):].strip("/")
        raise TrackerFailure("the server keeps the run's artifacts on another host, which gets no credential "
                             "from this worker; the adapter was not uploaded")


def _field(payload: Any, call: str, *keys: str) -> Any:
    for key in keys:
        if not isinstance(payload, dict) or key not in payload:
            raise TrackerFailure(f"the answer to {call} has no {'.'.join(keys)}")
        payload = payload[key]
    return payload


def _upload_with_mlflow(artifact_uri: str, directory: Path) -> None:
    """An artifact store the server does not proxy: MLflow's client for it, with that store's own
    credentials (boto3's for ``s3://`` ...), never the tracking server's."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    get_artifact_repository(artifact_uri).log_artifacts(str(directory), artifact_path="adapter")


def metric_points(events: list[dict[str, Any]]) -> list[tuple[str, float, int, int]]:
    """``(key, value, timestamp ms, step)`` for each numeric field of the step and eval events."""
    points = []
    for event in events:
        kind, step = event.get("type"), event.get("step")
        if kind not in ("step", "eval") or not isinstance(step, int):
            continue
        ts = int(float(event.get("time") or time.time()) * 1000)
        fields = STEP_METRICS if kind == "step" else ("loss",)
        prefix = "train" if kind == "step" else "eval"
        for name in fields:
            value = event.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                points.append((f"{prefix}/{name}", float(value), ts, step))
    return points
