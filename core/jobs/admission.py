"""Whether the box can run a job spec: the checks every job passes before it is queued, new
(``core.jobs.service.create_job``) or queued again (a paused job: ``core.jobs.submit``).

The spec itself was validated when it was parsed (``core.jobs.spec``); here it meets the box:
its files (there, of the right purpose and project, of a format its objective trains on), its
model (resolvable), its method, switches, trackers and GPUs (some live worker can honour them;
the owner's cap and the project's quota allow them), and the trainer's own config checks. Each
check reads; nothing is written.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy.orm import Session

from core.db import utcnow
from core.errors import InvalidInput, Unsupported
from core.files.models import File
from core.jobs import grpo_checks
from core.jobs.model_source import resolve_model
from core.jobs.scheduling import check_gpus, check_project
from core.jobs.spec import JobSpec
from core.jobs.trackers import allowed_trackers, check_trackers
from core.jobs.translate import to_train_config
from core.projects.models import Project
from core.settings import Settings
from core.workers import registry
from trainer import objectives
from trainer.config import SWITCHES


def admit(session: Session, spec: JobSpec, *, settings: Settings, owner_id: str | None, project_id: str | None,
          job_id: str) -> None:
    """Check that the box can run ``spec`` as job ``job_id`` of ``owner_id`` in ``project_id``
    (a new job, or a paused one queued again); writes nothing.

    Raises:
        Unsupported: ``method`` is ``qlora`` and no live worker reports a CUDA GPU with
            bitsandbytes (``_check_method``).
        InvalidInput: unknown or deleted file ids, a file of the wrong purpose, a file whose
            format does not fit ``objective`` (preference files for dpo, prompts for grpo, others for
            sft), a GRPO job's grader (``core.jobs.grpo_checks.check_grader``), a model
            that cannot be resolved, or a spec the trainer's config refuses.
        Unsupported: an optimization forced ``on`` that no live worker can honour,
            ``gpus`` that no live host or the owner's cap can give (``core.jobs.scheduling.check_gpus``),
            or a tracker whose package no live worker has (``core.jobs.trackers.check_trackers``).
        InvalidInput: a tracking server or URL the box, or the job's project, does not list
            (``core.jobs.trackers.server_for``).
    """
    _check_method(session, spec, settings)
    _check_forced_switches(session, spec, settings)
    project = session.get(Project, project_id) if project_id is not None else None
    check_trackers(spec.tracking.model_dump(), _live_reports(session, settings), allowed_trackers(settings, project))
    check_gpus(session, spec.gpus, settings, owner_id=owner_id, nodes=spec.nodes, pool_name=spec.pool,
               method=spec.method)
    check_project(session, project_id, spec.gpus, spec.priority)
    train_row = usable_file(session, spec.training_file, "train", "training_file", project_id)
    _check_objective(spec.objective, train_row, "training_file")
    if spec.objective == "grpo":
        grpo_checks.check_grader(spec.grpo.graders)
        grpo_checks.check_no_validation(spec.validation_file)
    paths = {spec.training_file: train_row.path}
    if spec.validation_file is not None:
        validation_row = usable_file(session, spec.validation_file, "validation", "validation_file", project_id)
        _check_objective(spec.objective, validation_row, "validation_file")
        paths[spec.validation_file] = validation_row.path
    source = resolve_model(spec.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models,
                           check_hub=True)
    to_train_config(spec, job_id=job_id, files=paths, output_dir=settings.jobs_dir / job_id,
                    model_path=source.name_or_path)


def _check_forced_switches(session: Session, spec: JobSpec, settings: Settings) -> None:
    """Refuse a switch forced ``on`` that no live worker's trainer can honour.

    Each worker stores ``python -m trainer detect --json`` in ``worker.hardware``; its
    ``capabilities`` map each switch (``trainer.config.SWITCHES``) to None (``on`` can run
    there) or the reason it cannot.
    A worker is live when its heartbeat is younger than ``heartbeat_timeout_s``. With no live
    worker that reported capabilities (none started yet, or an older trainer) the job is
    accepted and waits: the trainer's own plan refuses an impossible ``on`` when the job starts
    (``done`` with ``config_error``), so nothing impossible runs either way.

    Raises:
        Unsupported: some switch is ``on`` and every reporting live worker says it cannot be.
    """
    forced = [name for name in SWITCHES if getattr(spec.optimizations, name) == "on"]
    if not forced:
        return
    reports = [(worker_id, report.get("capabilities")) for worker_id, report in _live_reports(session, settings)]
    reports = [(worker_id, caps) for worker_id, caps in reports if isinstance(caps, dict)]
    if not reports:
        return
    for name in forced:
        reasons = {
            worker_id: caps.get(name, "its trainer does not know this switch")
            for worker_id, caps in reports
        }
        if any(reason is None for reason in reasons.values()):
            continue
        why = "; ".join(f"worker {worker_id}: {reason}" for worker_id, reason in sorted(reasons.items()))
        raise Unsupported(
            f"optimizations.{name}: on cannot be honoured by any live worker ({why}). "
            f"Set optimizations.{name} to auto or off",
            param=f"optimizations.{name}",
        )


def _check_method(session: Session, spec: JobSpec, settings: Settings) -> None:
    """Refuse ``method: qlora`` unless a live worker reports a CUDA GPU with bitsandbytes.

    Reads ``hardware.device`` and ``hardware.bitsandbytes`` of the ``detect --json`` report each
    worker stores (``worker.presence``), from the workers ``_check_forced_switches`` reads: those
    with a heartbeat younger than ``heartbeat_timeout_s``. Every live worker can claim a job of
    one GPU, so any one of them able to load a 4-bit base is enough. Unlike a forced switch, a
    box with no such report refuses (no live worker, or none whose detect has finished): a 4-bit
    base exists only with bitsandbytes on CUDA, so the caller gets the fix now rather than a
    queued job that can only fail at its start. A worker gains the report when it restarts.

    Raises:
        Unsupported: ``method`` is ``qlora`` and no live worker reports both.
    """
    if spec.method != "qlora":
        return
    reports = _live_reports(session, settings)
    gaps = {worker_id: _qlora_gap(report) for worker_id, report in reports}
    if any(gap is None for gap in gaps.values()):
        return
    fix = "Use method lora, or install bitsandbytes on a GPU worker (pip install 'ftq[qlora]') and restart it"
    if not gaps:
        raise Unsupported(
            "method: qlora needs a worker with a CUDA GPU and bitsandbytes; no worker is live "
            f"(none has sent a heartbeat in the last {settings.heartbeat_timeout_s:g} s). {fix}",
            param="method",
        )
    why = "; ".join(f"worker {worker_id}: {gap}" for worker_id, gap in sorted(gaps.items()))
    raise Unsupported(
        f"method: qlora needs a worker with a CUDA GPU and bitsandbytes; no live worker has both ({why}). {fix}",
        param="method",
    )


def _qlora_gap(report: dict[str, Any]) -> str | None:
    """None when a worker's report shows a CUDA device with bitsandbytes, else what it lacks."""
    hardware = report.get("hardware")
    if not isinstance(hardware, dict):
        return "no hardware report (its trainer detect failed or has not finished)"
    has_cuda = hardware.get("device") == "cuda"
    has_bnb = hardware.get("bitsandbytes") is True
    if has_cuda and has_bnb:
        return None
    missing = " or ".join(what for what, present in (("CUDA", has_cuda), ("bitsandbytes", has_bnb)) if not present)
    return f"{hardware.get('name', 'unknown device')} ({hardware.get('device', 'unknown')}) without {missing}"


def _live_reports(session: Session, settings: Settings) -> list[tuple[str, dict[str, Any]]]:
    """``(worker_id, detect report)`` of each worker whose heartbeat is younger than
    ``heartbeat_timeout_s``; a worker that registered before its detect finished has ``{}``."""
    cutoff = utcnow() - dt.timedelta(seconds=settings.heartbeat_timeout_s)
    workers = registry.live_workers(session, cutoff=cutoff)
    return [(worker.worker_id, worker.hardware if isinstance(worker.hardware, dict) else {}) for worker in workers]


def _check_objective(objective: str, row: File, param: str) -> None:
    """The file's record format is one the objective trains on (``trainer.objectives``' formats)."""
    declared = objectives.declaration(objective)
    if row.format in declared.formats:
        return
    owner = next((d.name for d in objectives.declarations() if row.format in d.formats), None)
    fix = f"objective {objective} trains on {' or '.join(declared.formats)} records; upload such a file"
    if owner is not None:
        fix += f", or set objective to {owner}"
    raise InvalidInput(f"{param}: file {row.file_id} holds {row.format} records, but {fix}", param=param)


def usable_file(session: Session, file_id: str, purpose: str, param: str, project_id: str | None = None) -> File:
    """The file row a spec names in ``param``; InvalidInput when it is missing, of another
    purpose, or (``project_id``) of another project (said as for an unknown id)."""
    row = session.get(File, file_id)
    if row is None or row.deleted_at is not None or project_id not in (None, row.project_id):
        raise InvalidInput(f"{param}: no file {file_id!r}; upload it with POST /v1/files (purpose={purpose}) "
                           "and use its id", param=param)
    if row.purpose != purpose:
        raise InvalidInput(f"{param}: file {file_id} was uploaded with purpose={row.purpose}; upload it again with "
                           f"purpose={purpose}", param=param)
    return row
