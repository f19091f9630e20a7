"""MLflow: one run per job run in an experiment; the spec as params, step and eval metrics by step,
the adapter (or the full model) as the run's ``adapter`` artifact, the run ended with the job's state.

Metric keys: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``train/mfu``
... (each numeric field of the step event) and ``eval/loss``. Params are the stored spec flattened
with dots (``hyperparameters.learning_rate``), plus ``job_id`` and ``model``; the run carries the tags
``ftq.job_id`` and ``ftq.owner``. The HTTP client is set to give up fast (10 s, one retry: the
``MLFLOW_HTTP_REQUEST_*`` variables, unless the worker's environment sets them), so a down server
costs a warning within seconds, not MLflow's default of minutes of retries.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from worker.tracking.dispatch import JobInfo

STEP_METRICS = ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms", "mfu", "epoch",
                "gpu_mem_peak", "reward_margin", "reward_accuracy")
END_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "queued": "KILLED", "lost": "KILLED"}
"""A job handed back (``queued``) or lost to another worker ends its run as KILLED; its next attempt is a new run."""
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000


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
    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.label = f"MLflow at {tracking_uri}"
        self.run_id: str | None = None
        self._client: Any = None

    def start(self, job: JobInfo) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
        tags = {"ftq.job_id": job.job_id, "ftq.owner": job.owner or ""}
        run = self._client.create_run(experiment_id, run_name=job.name or job.job_id, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in {**flatten(job.spec), "job_id": job.job_id, "model": job.model}.items()]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_BATCH])

    def log(self, events: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ts, step) for key, value, ts, step in metric_points(events)]
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_PER_BATCH])

    def finish(self, status: str, artifact_dir: Path | None) -> None:
        if artifact_dir is not None and Path(artifact_dir).is_dir():
            self._client.log_artifacts(self.run_id, str(artifact_dir), artifact_path="adapter")
        self._client.set_terminated(self.run_id, status=END_STATUS.get(status, "FAILED"))


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
