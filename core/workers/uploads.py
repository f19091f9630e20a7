"""What a remote worker may upload into a job's store beyond its key's access, and what is
removed from the store once the job ends.

An upload (``PUT /v1/worker/jobs/{id}/artifacts/{path}``, api/workers/artifacts.py) passes
``core.workers.access`` (the key's worker runs the job, or that export), then:

    checkpoints/step-N   N at most the job's last step (``total_steps``: the spec's ``max_steps``
                         or the trainer's plan) and at most ``STEP_MARGIN`` past the newest step
                         or checkpoint the store recorded (422); a recorded checkpoint is never
                         replaced (409)
    completions.*        only of a job of kind generate or eval (422)
    every path           a tar of at most ``worker_upload_max_members`` members, and the job's
                         store within ``worker_upload_quota_gib`` once it is unpacked (413,
                         ``Quota``; counted while the body arrives and while it is unpacked)

Once a job has ended nothing more is uploaded for it (access), so what its store holds and the
store never recorded stays unrecorded: ``sweep_finished`` removes checkpoints without a row,
``exports/<id>`` without an export of the job (or of a failed one), the final weights of a
job that did not succeed, and ``completions.parts`` once ``completions.jsonl`` holds every line. ``core.jobs.service.transition``, the one function that ends a job,
stamps ``finished_at``; it runs wherever the job ends (on a remote worker's machine, which does
not hold the API's disk), so the API sweeps by that stamp: every finished job at its start,
then those that finished lately (api/workers/sweeper.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.errors import Conflict, InvalidInput, TooLarge
from core.exports.models import Export
from core.jobs import artifact_store
from core.jobs.models import Checkpoint, Job
from core.jobs.states import FINISHED_STATUSES, JobStatus
from core.settings import Settings
from core.workers import archive
from trainer.training import layout

log = logging.getLogger(__name__)

STEP_MARGIN = 1000
"""Steps a checkpoint upload may run ahead of the job's recorded progress. The worker uploads
checkpoint N once the trainer's step event N is in its recorder, which writes events to the
store in batches (``FTQ_EVENT_FLUSH_INTERVAL_S``, 0.5 s) from another thread than the upload's:
the store may not show step N yet when checkpoint N arrives. ``total_steps`` is the hard bound."""
TAR_OVERHEAD_PER_MEMBER = 6 * 1024
"""Bytes a tar spends per member besides its data, at most: a header, a pax header with a name
of up to 4096 bytes, and the padding of the data to 512."""
GIB = 1 << 30
FAILED_EXPORT = "failed"


def check_upload(session: Session, job: Job, path: str) -> None:
    """Refuse a checkpoint of a step ``job`` cannot have reached, or one already recorded, and a
    generation output (``completions.jsonl``, ``completions.parts``) of a job that is not one.

    Raises:
        Conflict: ``checkpoints/step-N`` of a recorded checkpoint.
        InvalidInput: a step past ``total_steps`` or more than ``STEP_MARGIN`` past the progress;
            a generation output of a training job or a session.
    """
    if path in layout.GENERATION_OUTPUTS and job.kind not in ("generate", "eval"):
        raise InvalidInput(f"path: {path} is a generation job's output, and job {job.job_id} is a {job.kind} job",
                           param="path")
    parts = path.split("/")
    step = layout.parse_checkpoint_step(parts[1]) if len(parts) == 2 and parts[0] == layout.CHECKPOINTS else None
    if step is None:
        return
    if session.get(Checkpoint, (job.job_id, step)) is not None:
        raise Conflict(f"path: checkpoint {step} of job {job.job_id} is recorded, and a recorded checkpoint is "
                       "never replaced; upload the checkpoints of later steps", param="path")
    if job.total_steps is not None and step > job.total_steps:
        raise InvalidInput(f"path: step {step} is past job {job.job_id}'s last step, {job.total_steps}; upload "
                           "only the checkpoints of steps the job runs", param="path")
    newest = session.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job.job_id)) or 0
    reached = max(job.progress_step or 0, newest)
    if step > reached + STEP_MARGIN:
        raise InvalidInput(f"path: step {step} is more than {STEP_MARGIN} steps past the last step job "
                           f"{job.job_id} has recorded ({reached}); upload a checkpoint once its step has run",
                           param="path")


def _gib(size: int) -> str:
    return f"{size / GIB:,.1f}"


@dataclass(frozen=True)
class Quota:
    """What a job's store may still take from one upload of ``path`` (``measure``)."""

    job_id: str
    quota: int
    """``worker_upload_quota_gib`` in bytes."""
    stored: int
    """Bytes in the job's store now, uploads in flight and the artifact this one replaces left out."""
    max_members: int

    @classmethod
    def measure(cls, settings: Settings, job_id: str, path: str) -> Quota:
        root = artifact_store.job_store_dir(settings, job_id)
        skip = frozenset({artifact_store.incoming_dir(settings, job_id),
                          artifact_store.artifact_path(settings, job_id, path)})
        return cls(job_id, int(settings.worker_upload_quota_gib * GIB), artifact_store.tree_bytes(root, skip=skip),
                   settings.worker_upload_max_members)

    @property
    def left(self) -> int:
        return max(self.quota - self.stored, 0)

    def hint(self) -> str:
        return (f"job {self.job_id} may keep {_gib(self.quota)} GiB of uploads on the API's disk and holds "
                f"{_gib(self.stored)} GiB already: raise FTQ_WORKER_UPLOAD_QUOTA_GIB on the API's machine, or "
                "checkpoint less often (checkpoint_every)")

    def limits(self) -> archive.Limits:
        """The reader's bounds: the member cap and what the quota leaves."""
        return archive.Limits(
            max_members=self.max_members, max_bytes=self.left, bytes_hint=self.hint(),
            members_hint="an artifact is a few files; raise FTQ_WORKER_UPLOAD_MAX_MEMBERS on the API's machine "
                         "for one that needs more",
        )

    def check_body(self, incoming: Path, own: Path, received: int) -> None:
        """Refuse a body that cannot fit: the bytes of the job's uploads in flight (this one's
        ``received`` so far included) past what the quota leaves plus a tar's own overhead.

        Raises:
            TooLarge: naming the quota and its setting.
        """
        in_flight = artifact_store.tree_bytes(incoming, skip=frozenset({own})) + received
        if in_flight > self.left + self.max_members * TAR_OVERHEAD_PER_MEMBER:
            raise TooLarge(f"body: {received:,} bytes and more do not fit in what is left of the upload quota; "
                           f"{self.hint()}", param="body")


def sweep_finished(session: Session, settings: Settings, *, since: dt.datetime | None = None) -> list[Path]:
    """Remove what finished jobs' stores hold and the store never recorded (``sweep_job``):
    every finished job's, or those of jobs (and failed exports) that finished at ``since`` or
    later. Returns what was removed."""
    query = select(Job.job_id, Job.status).where(Job.status.in_([s.value for s in FINISHED_STATUSES]))
    if since is not None:
        failed_exports = select(Export.job_id).where(Export.status == FAILED_EXPORT, Export.finished_at >= since)
        query = query.where((Job.finished_at >= since) | Job.job_id.in_(failed_exports))
    removed: list[Path] = []
    for job_id, status in session.execute(query).all():
        if artifact_store.job_store_dir(settings, job_id).is_dir():
            removed += sweep_job(session, settings, job_id, JobStatus(status))
    return removed


def sweep_job(session: Session, settings: Settings, job_id: str, status: JobStatus) -> list[Path]:
    """Remove from finished job ``job_id``'s store: checkpoints without a row, exports that are
    no export of the job or a failed one, and its final weights unless it succeeded. Skipped
    (nothing removed) while an upload holds the job's store lock: the next sweep comes back."""
    if not _unrecorded(session, settings, job_id, status):
        return []
    removed: list[Path] = []
    with artifact_store.job_lock(settings, job_id, wait=False) as locked:
        if not locked:
            return []
        for path in _unrecorded(session, settings, job_id, status):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("job %s (%s): removed %d unrecorded upload(s): %s", job_id, status.value, len(removed),
                 ", ".join(p.relative_to(artifact_store.job_store_dir(settings, job_id)).as_posix() for p in removed))
    return removed


def _unrecorded(session: Session, settings: Settings, job_id: str, status: JobStatus) -> list[Path]:
    """The candidates, among the names a worker may upload only (``layout.check_artifact_path``):
    a local run's ``step-N.tmp`` or ``exports/<id>.tmp`` being written is never one."""
    root = artifact_store.job_store_dir(settings, job_id)
    steps = {layout.parse_checkpoint_step(path.name): path for path in _uploadable(root, layout.CHECKPOINTS)}
    found: list[Path] = []
    if steps:
        recorded = set(session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id,
                                                                     Checkpoint.step.in_(list(steps)))))
        found += [path for step, path in sorted(steps.items()) if step not in recorded]
    if exports := _uploadable(root, layout.EXPORTS):
        kept = dict(session.execute(select(Export.export_id, Export.status).where(Export.job_id == job_id)).all())
        found += [path for path in exports if kept.get(path.name, FAILED_EXPORT) == FAILED_EXPORT]
    if status is not JobStatus.succeeded:
        found += [root / name for name in ("adapter", "model") if (root / name).exists()]
    if (root / layout.COMPLETIONS).is_file() and (root / layout.COMPLETION_PARTS).is_dir():
        found.append(root / layout.COMPLETION_PARTS)  # a remote run's parts, merged into its completions.jsonl
    return found


def _uploadable(root: Path, parent: str) -> list[Path]:
    if not (root / parent).is_dir():
        return []
    found = []
    for path in sorted((root / parent).iterdir()):
        try:
            found.append(root / layout.check_artifact_path(f"{parent}/{path.name}"))
        except ValueError:
            continue
    return found
