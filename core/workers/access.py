"""Which jobs a worker key may move bytes for: those claimed now by a worker running with it.

A worker key reaches a job's files only while one of its workers runs that job: the job's
claiming worker (``job.worker_id``), a machine of a multi-machine job's current attempt
(``job_node``), or the worker running one of the job's exports. Everything else is 403, so a
stolen key of one machine reads no other machine's jobs, and a job stops being reachable when
it ends or is claimed elsewhere. ``exports/<id>`` is written only by the worker running that
export of that job (an id that names no export of the job is 404). What else bounds an upload
(steps, immutable checkpoints, the quota) is ``core.workers.uploads``.

A chat session, generation job or eval run loads weights another job made: while it runs on a
worker with the key, that key may also download exactly the artifact its ``model`` (a session:
each of its ``models``) names, and nothing else of that job (``referenced_artifacts``):

    job:<id>           ``adapter`` (``model`` for a method ``full`` job) of that training job
    job:<id>@<step>    ``checkpoints/step-<step>`` of it
    export:<id>        ``exports/<id>`` of the export's job

and only when the named job is of the running job's project (or the running job has none), as
the API checked when it was submitted (``core.jobs.generation.resolve``). Its prompts file comes
down as a dataset (``check_file_access``: ``training_file_id`` holds it).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import Forbidden, NotFound
from core.exports.models import Export
from core.files.models import File
from core.jobs.generate_spec import EXPORT_REF, JOB_REF
from core.jobs.models import Job, JobNode
from core.jobs.states import JobStatus
from core.workers.models import Worker
from trainer.training import layout


def job_worker_ids(session: Session, job: Job) -> set[str]:
    """The workers running ``job`` now: its claiming worker and, for a multi-machine job, every
    machine of its current attempt whose part has not ended."""
    if job.status != JobStatus.running.value:
        return set()
    found = {job.worker_id} if job.worker_id else set()
    nodes = session.scalars(
        select(JobNode.worker_id).where(
            JobNode.job_id == job.job_id, JobNode.attempt == job.attempts, JobNode.ended_at.is_(None)
        )
    )
    return found | set(nodes)


def export_worker_ids(session: Session, job_id: str) -> dict[str, str]:
    """``{export_id: worker_id}`` of the job's exports running now."""
    rows = session.execute(
        select(Export.export_id, Export.worker_id).where(
            Export.job_id == job_id, Export.status == "running", Export.worker_id.is_not(None)
        )
    )
    return {export_id: worker_id for export_id, worker_id in rows}


def _keyed(session: Session, worker_ids: set[str], key_id: str) -> bool:
    if not worker_ids:
        return False
    return session.scalar(
        select(Worker.worker_id).where(Worker.worker_id.in_(worker_ids), Worker.key_id == key_id).limit(1)
    ) is not None


def check_job_access(session: Session, key_id: str, job_id: str, path: str, *, upload: bool) -> Job:
    """The job, if worker key ``key_id`` may read (or, with ``upload``, write) ``path`` of it.

    A job's running worker may read and write every artifact but its exports; an export's worker
    may read the job's artifacts and write only ``exports/<its export id>``.

    Raises:
        NotFound: no such job, or (upload) ``exports/<id>`` names no export of this job.
        Forbidden: no worker with this key runs the job (or the export) now.
    """
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist", param="job_id")
    parts = path.split("/")
    if upload and len(parts) == 2 and parts[0] == layout.EXPORTS:
        return _check_export_upload(session, key_id, job, parts[1])
    if _keyed(session, job_worker_ids(session, job), key_id):
        return job
    if not upload and _keyed(session, set(export_worker_ids(session, job_id).values()), key_id):
        return job
    if not upload and _referenced(session, key_id, job, path):
        return job
    raise Forbidden(
        f"job {job_id} is not running on a worker with this worker key ({'write' if upload else 'read'} "
        f"{path[:200]!r}); a worker moves only the files of the jobs and exports it has claimed",
        param="job_id",
    )


LOADS_WEIGHTS = ("generate", "eval", "session")
"""Job kinds whose ``model`` may name another job's weights."""


def _model_refs(job: Job) -> list[str]:
    spec = job.spec or {}
    return list(spec.get("models") or []) if job.kind == "session" else [spec.get("model") or ""]


def referenced_artifacts(session: Session, job: Job) -> set[tuple[str, str]]:
    """``(job id, artifact path)`` of each weights ``job`` loads from another job's store (see the
    module docstring); a reference to a job or export of another project is left out."""
    found: set[tuple[str, str]] = set()
    for model in _model_refs(job):
        if (ref := JOB_REF.match(model)) is not None:
            source = session.get(Job, ref["job_id"])
            if source is None or source.kind != "train" or job.project_id not in (None, source.project_id):
                continue
            path = (layout.export_name(source.method) if ref["step"] is None
                    else f"{layout.CHECKPOINTS}/{layout.checkpoint_name(int(ref['step']))}")
            found.add((source.job_id, path))
        elif (ref := EXPORT_REF.match(model)) is not None:
            export = session.get(Export, ref["export_id"])
            if export is not None and job.project_id in (None, export.project_id):
                found.add((export.job_id, f"{layout.EXPORTS}/{export.export_id}"))
    return found


def _referenced(session: Session, key_id: str, source: Job, path: str) -> bool:
    """A job running on a worker with key ``key_id`` loads ``path`` of ``source``."""
    running = session.scalars(
        select(Job).join(Worker, Worker.worker_id == Job.worker_id).where(
            Job.status == JobStatus.running.value, Job.kind.in_(LOADS_WEIGHTS), Worker.key_id == key_id)
    )
    return any((source.job_id, path) in referenced_artifacts(session, job) for job in running)


def _check_export_upload(session: Session, key_id: str, job: Job, export_id: str) -> Job:
    export = session.get(Export, export_id)
    if export is None or export.job_id != job.job_id:
        raise NotFound(f"path: job {job.job_id} has no export {export_id}; a worker uploads an export only to "
                       "exports/<the id of the export it runs>", param="path")
    if export.status != "running" or not _keyed(session, {export.worker_id} if export.worker_id else set(), key_id):
        raise Forbidden(
            f"export {export_id} of job {job.job_id} is not running on a worker with this worker key (it is "
            f"{export.status}); a worker uploads only the exports it has claimed, before it marks them done",
            param="job_id",
        )
    return job


def check_file_access(session: Session, key_id: str, file_id: str) -> File:
    """The dataset ``file_id``, if a job running on a worker with key ``key_id`` trains on it.

    Raises:
        NotFound: no such file (or it was deleted).
        Forbidden: no job running on this key's workers reads it.
    """
    row = session.get(File, file_id)
    if row is None or row.deleted_at is not None:
        raise NotFound(f"file {file_id} does not exist", param="file_id")
    jobs = session.scalars(
        select(Job).where(
            Job.status == JobStatus.running.value,
            (Job.training_file_id == file_id) | (Job.validation_file_id == file_id),
        )
    )
    for job in jobs:
        if _keyed(session, job_worker_ids(session, job), key_id):
            return row
    raise Forbidden(
        f"file {file_id} is not a dataset of a job running on a worker with this worker key; "
        "a worker downloads only the datasets of the jobs it has claimed",
        param="file_id",
    )
