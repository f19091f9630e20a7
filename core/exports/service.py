"""Exports of a finished job: create (API), claim / progress / finish (worker), read.

An export is a row (``core.exports.models.Export``) and a directory
``<job output_dir>/exports/<export_id>/``. Its status moves queued → running → succeeded |
failed, each move one conditional ``UPDATE`` (as for jobs), so a redelivered task finds the row
taken. Progress and the final state are also appended to the job's event history as ``export``
events, so the job page's SSE stream shows them live.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, InvalidInput, NotFound
from core.exports.models import Export
from core.jobs.models import Job
from core.jobs.service import append_events, get_job
from core.jobs.states import JobStatus
from core.users.service import Caller
from trainer.catalog import DEFAULT_QUANTIZATION, EXPORT_FORMATS, GGUF_MODEL_TYPES, QUANTIZATIONS

STAGE_WEIGHTS = {"merged": {"load": (0.0, 0.5), "merge": (0.5, 0.1), "save": (0.6, 0.4)},
                 "gguf": {"load": (0.0, 0.3), "merge": (0.3, 0.05), "save": (0.35, 0.15), "convert": (0.5, 0.5)}}
"""Per format, each stage's (start, share) of the whole export, for one progress number."""
ACTIVE = ("queued", "running")
EXPORTS_DIR = "exports"


def create_export(session: Session, job_id: str, fmt: str, quantization: str | None, *,
                  owner_id: str | None, model_type: str | None) -> tuple[Export, bool]:
    """A new queued export of ``job_id``, or the queued/running one of the same kind (False).

    ``model_type``: the base's ``config.json`` ``model_type`` when known, to refuse a GGUF of an
    architecture the writer does not support before any worker loads the model.
    """
    job = get_job(session, job_id)
    if job.status != JobStatus.succeeded.value:
        raise Conflict(f"job {job_id} is {job.status}; it can be exported once it has succeeded", param="job_id")
    if fmt not in EXPORT_FORMATS:
        raise InvalidInput(f"format: {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}", param="format")
    if fmt == "merged" and quantization is not None:
        raise InvalidInput("quantization: only format gguf has one; leave it out for merged", param="quantization")
    if fmt == "gguf":
        quantization = quantization or DEFAULT_QUANTIZATION
        if quantization not in QUANTIZATIONS:
            raise InvalidInput(f"quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}",
                               param="quantization")
        if model_type is not None and model_type not in GGUF_MODEL_TYPES:
            raise InvalidInput(f"format: gguf supports the architectures {', '.join(GGUF_MODEL_TYPES)}; this "
                               f"job's base is {model_type!r} (format merged works for every model)", param="format")
    same_kind = Export.quantization.is_(None) if quantization is None else Export.quantization == quantization
    running = session.scalars(select(Export).where(
        Export.job_id == job_id, Export.format == fmt, same_kind, Export.status.in_(ACTIVE))).first()
    if running is not None:
        return running, False
    export = Export(export_id=new_id("exp"), job_id=job_id, format=fmt, quantization=quantization,
                    status="queued", progress=0.0, owner_id=owner_id, project_id=job.project_id,
                    worker_id=job.worker_id)
    session.add(export)
    session.flush()
    _event(session, export)
    return export, True


def get_export(session: Session, job_id: str, export_id: str, *, reader: Caller | None = None) -> Export:
    """The export ``export_id`` of job ``job_id``; ``reader`` as for ``core.jobs.service.get_job``
    (a job of another project is NotFound as an unknown one)."""
    get_job(session, job_id, reader=reader)
    export = session.get(Export, export_id)
    if export is None or export.job_id != job_id:
        raise NotFound(f"export {export_id} of job {job_id} does not exist", param="export_id")
    return export


def list_exports(session: Session, job_id: str, *, reader: Caller | None = None) -> list[Export]:
    get_job(session, job_id, reader=reader)
    return list(session.scalars(select(Export).where(Export.job_id == job_id).order_by(Export.created_at)))


def export_dir(job: Job, export_id: str) -> Path:
    """``<job output_dir>/exports/<export_id>``."""
    return Path(job.output_dir or ".") / EXPORTS_DIR / export_id


def claim(session: Session, export_id: str, worker_id: str) -> Export | None:
    """queued → running for this worker; None when another claim won or the row is gone."""
    return _transition(session, export_id, "queued", status="running", worker_id=worker_id, started_at=utcnow())


def record_progress(session: Session, export_id: str, stage: str, fraction: float) -> None:
    """The trainer's ``progress`` event as one overall fraction on the row and a job event."""
    export = session.get(Export, export_id)
    if export is None or export.status != "running":
        return
    start, share = STAGE_WEIGHTS.get(export.format, {}).get(stage, (export.progress, 0.0))
    export.stage = stage
    export.progress = round(max(export.progress, start + share * min(max(fraction, 0.0), 1.0)), 4)
    session.flush()
    _event(session, export)


def finish(session: Session, export_id: str, *, path: str | None, size: int | None,
           error_code: str | None = None, message: str | None = None) -> Export | None:
    """running → succeeded (``path``, ``size``) or failed (``error_code``, ``message``)."""
    status = "failed" if error_code else "succeeded"
    values: dict[str, Any] = {"status": status, "finished_at": utcnow(), "error_code": error_code,
                              "error_message": message, "path": path, "bytes": size}
    if status == "succeeded":
        values.update(progress=1.0, stage=None)
    return _transition(session, export_id, "running", **values)


def _transition(session: Session, export_id: str, from_status: str, **values: Any) -> Export | None:
    """``from_status`` → ``values`` in one conditional UPDATE (two claims cannot both win); the
    row as it is now, with its job event, or None when the row was not in ``from_status``."""
    won = session.execute(
        update(Export).where(Export.export_id == export_id, Export.status == from_status).values(**values)
        .execution_options(synchronize_session=False)
    ).rowcount == 1
    if not won:
        return None
    export = session.get(Export, export_id)
    session.refresh(export)
    _event(session, export)
    return export


def view(export: Export) -> dict[str, Any]:
    """The row as the API, the events and the CLI show it."""
    return {
        "id": export.export_id, "job_id": export.job_id, "format": export.format,
        "quantization": export.quantization, "status": export.status, "stage": export.stage,
        "progress": export.progress, "bytes": export.bytes, "error_code": export.error_code,
        "error_message": export.error_message,
        "created_at": export.created_at.isoformat() if export.created_at else None,
        "finished_at": export.finished_at.isoformat() if export.finished_at else None,
    }


def last_seq(session: Session, job_id: str) -> int:
    """The job's newest event seq (to publish to live viewers after commit)."""
    return session.execute(select(Job.last_event_seq).where(Job.job_id == job_id)).scalar_one()


def _event(session: Session, export: Export) -> None:
    append_events(session, export.job_id, [("export", view(export))])
