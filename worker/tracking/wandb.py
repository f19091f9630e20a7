"""Weights & Biases: one run per job run; the spec as the run's config, step and eval metrics by
step, the adapter (or the full model) as a ``model`` artifact, the run finished with the job's state.

Metric keys are MLflow's (``worker.tracking.mlflow.metric_points``: ``train/loss``, ``train/lr``, ...,
``eval/loss``), logged with ``step=`` the trainer's step, so W&B's x-axis is the job's. The config is
the stored spec (nested, as W&B shows it) plus ``job_id`` and ``model``; the summary holds
``ftq/status`` (the job's status as ftq names it). The run's exit code: 0 for a job that succeeded,
1 otherwise (W&B shows ``finished`` or ``failed``).

The server and its key are the listed W&B server's (``core.jobs.trackers.allowed_trackers``): its
``url`` as W&B's ``base_url`` and the value of its ``credential_env`` as ``api_key``, both passed
explicitly, so W&B never falls back to another key of the worker (``WANDB_API_KEY``, ``.netrc``).
A server configured without a credential runs only offline (W&B sends every request with a key,
and would otherwise take the worker's ``WANDB_API_KEY``).
The box's implicit ``wandb`` server is W&B as the worker's environment configures it
(``WANDB_BASE_URL``, ``WANDB_API_KEY``). The rest is W&B's own environment on the worker:
``WANDB_MODE=offline`` (files only; ``wandb sync`` uploads them later), ``WANDB_DIR`` (where the
run files go; unset: the job's own directory). The run
neither captures the worker's console nor records its system metrics or metadata (command line, git
state, installed packages): those describe the worker process, which several jobs share, not the training. Each run is separate (``reinit="create_new"``), so jobs running at
once on one worker never log into each other's run.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from worker.tracking.dispatch import JobInfo, TrackerFailure
from worker.tracking.mlflow import metric_points

_INIT = threading.Lock()
"""W&B logs in once per process (``wandb_login``, an explicit key becomes the process's auth), so two
jobs starting runs on two servers at once could cross keys: their ``wandb.init`` calls take turns."""
INIT_TIMEOUT_S = 30.0
"""How long ``wandb.init`` waits for the server (W&B's default is 90 s); ``WANDB_INIT_TIMEOUT`` overrides."""


def exit_code(status: str) -> int:
    """0 (W&B ``finished``) for ``succeeded``; 1 (``failed``) for a job that failed, was cancelled,
    handed back (``queued``) or lost: its next attempt is a new run."""
    return 0 if status == "succeeded" else 1


class WandbTracker:
    def __init__(self, *, project: str, entity: str | None = None, name: str | None = None,
                 tags: tuple[str, ...] = (), directory: Path | None = None, server: str = "wandb",
                 base_url: str | None = None, api_key: str | None = None, credential_env: str | None = None) -> None:
        """``directory``: where the run files go unless the worker's ``WANDB_DIR`` says; ``server``:
        the listed W&B server's name, ``base_url`` its URL (None: W&B's default), ``api_key`` the
        value of its ``credential_env``."""
        self.project = project
        self.entity = entity
        self.name = name
        self.tags = tags
        self.directory = directory
        self.server = server
        self.base_url = base_url
        self.label = f"W&B server {server}, project {entity + '/' if entity else ''}{project}"
        self.run: Any = None
        self._job_id = ""
        self._api_key = api_key
        self._credential_env = credential_env

    def start(self, job: JobInfo) -> None:
        import wandb

        self._job_id = job.job_id
        directory = None
        if not os.environ.get("WANDB_DIR") and self.directory is not None:
            directory = self.directory
            directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(
            console="off",
            x_disable_stats=True,
            x_disable_meta=True,
            x_save_requirements=False,
            disable_git=True,
            save_code=False,
            silent=True,
            init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT") or INIT_TIMEOUT_S),
            **self._server_settings(),
        )
        with _INIT:
            self.run = self._init(wandb, job, directory, settings)
        self.run.summary["ftq/job_id"] = job.job_id
        if job.owner:
            self.run.summary["ftq/owner"] = job.owner

    def _init(self, wandb: Any, job: JobInfo, directory: Path | None, settings: Any) -> Any:
        return wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name or job.name or job.job_id,
            tags=list(self.tags) or None,
            config={**job.spec, "job_id": job.job_id, "model": job.model},
            job_type="fine-tune",
            dir=str(directory) if directory is not None else None,
            reinit="create_new",
            settings=settings,
        )

    def _server_settings(self) -> dict[str, Any]:
        """``base_url`` and ``api_key`` of this server, explicit. Online without a key is refused
        here, before W&B could find the worker's ``WANDB_API_KEY`` on its own, unless that is the
        variable configured for this server (then W&B's own login for its host is fine too)."""
        offline = os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "dryrun", "disabled")
        if self._api_key is None and not offline and self._credential_env != "WANDB_API_KEY":
            where = (f"{self._credential_env} is not set on this worker" if self._credential_env
                     else "it is configured without a credential (credential_env)")
            raise TrackerFailure(f"W&B needs an API key and {where}")
        chosen = {"base_url": self.base_url, "api_key": self._api_key}
        return {key: value for key, value in chosen.items() if value is not None}

    def log(self, events: list[dict[str, Any]]) -> None:
        for step, metrics in by_step(metric_points(events)):
            self.run.log(metrics, step=step)

    def finish(self, status: str, artifact_dir: Path | None) -> None:
        import wandb

        if artifact_dir is not None and Path(artifact_dir).is_dir():
            artifact = wandb.Artifact(f"ftq-{self._job_id}", type="model",
                                      metadata={"job_id": self._job_id, "status": status})
            artifact.add_dir(str(artifact_dir))
            self.run.log_artifact(artifact)
        self.run.summary["ftq/status"] = status
        self.run.finish(exit_code=exit_code(status))


def by_step(points: list[tuple[str, float, int, int]]) -> list[tuple[int, dict[str, float]]]:
    """``metric_points`` as one ``{key: value}`` per step, in the order the steps came. W&B keeps the
    row of the newest step open, so an eval event that arrives in the next batch, at the step just
    logged, still joins that step's row."""
    rows: dict[int, dict[str, float]] = {}
    for key, value, _ts, step in points:
        rows.setdefault(step, {})[key] = value
    return list(rows.items())
