"""Where the API keeps a job's files: its artifact store, ``<jobs_dir>/<job_id>/`` under the
API's own ``FTQ_DATA_DIR``, laid out as ``trainer.layout`` says.

A local worker shares the data directory, so it writes there directly. A remote worker writes
under its own data directory (the path the store's ``job.output_dir``, checkpoint and export
rows may record) and uploads each artifact here through ``PUT /v1/worker/jobs/{id}/artifacts/``.
Either way the API reads a job's files only through these functions, never from a path a worker
reported.
"""

from __future__ import annotations

from pathlib import Path

from core.settings import Settings
from trainer import layout

INCOMING = ".incoming"
"""Directory in a job's store where uploads are received and unpacked before their rename."""


def job_store_dir(settings: Settings, job_id: str) -> Path:
    return settings.jobs_dir / job_id


def artifact_path(settings: Settings, job_id: str, path: str) -> Path:
    """``<jobs_dir>/<job_id>/<path>`` for a ``path`` that ``layout.check_artifact_path`` allows."""
    return job_store_dir(settings, job_id) / layout.check_artifact_path(path)


def incoming_dir(settings: Settings, job_id: str) -> Path:
    return job_store_dir(settings, job_id) / INCOMING


def checkpoint_store_dir(settings: Settings, job_id: str, step: int) -> Path:
    return layout.checkpoint_dir(job_store_dir(settings, job_id), step)


def final_store_dir(settings: Settings, job_id: str, method: str) -> Path:
    """The finished run's weights: ``adapter/``, or ``model/`` for method ``full``."""
    return layout.export_dir(job_store_dir(settings, job_id), method)


def export_store_dir(settings: Settings, job_id: str, export_id: str) -> Path:
    return job_store_dir(settings, job_id) / layout.EXPORTS / export_id


def job_config_path(settings: Settings, job_id: str) -> Path:
    return job_store_dir(settings, job_id) / layout.JOB_CONFIG
