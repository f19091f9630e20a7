"""A remote worker's side of a job: what it fetches before the trainer runs and what it uploads.

A worker with ``FTQ_WORKER_KEY`` (``settings.remote_worker``) shares no disk with the API; the
store stays its channel for claims, events and heartbeats, and bytes go through the API
(worker/transfer.py). The runner and the export task call in here at a few points:

    claim       may_claim: a revoked key claims nothing (checked in the store at each claim)
                (its row's ``key_id`` and ``address``: worker/identity.py)
    config      fetch_datasets: the job's datasets, cached by sha256 under <data_dir>/cache/files
    run         job_outputs: on a retry, the newest recorded checkpoint is fetched if missing
                here (one the API has not either: the next older one, or none, said in a
                ``log`` event); then each ``checkpoint`` event is held back until its directory is
                uploaded (an uploader thread, training does not wait), and at the end job.json
                and adapter/ or model/ go up before the job may be ``succeeded`` (an upload
                that fails for good makes the attempt a retryable failure). A job whose
                machines share a checkpoint directory (``Claim.shared_home``) uploads no
                checkpoint: each is recorded as written there; its final weights, which rank 0
                gathers into this machine's output_dir, go up as any job's
    export      export_inputs / upload_export: job.json and the weights come down, the export
                goes up before it is marked done

A local worker gets ``LocalOutputs``, the no-op twin of ``RemoteOutputs``. A chat session's, a
generation job's and an eval run's weights and lines: worker/remote_generation.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.jobs.states import JobStatus
from trainer.training import layout
from worker.outcome import Outcome
from worker.transfer import TransferClient, TransferError, TransferNotFound

if TYPE_CHECKING:
    from core.jobs.models import Job
    from core.settings import Settings
    from worker.claim import Claim
    from worker.recorder import EventRecorder
    from worker.runtime import Runtime

log = logging.getLogger(__name__)


def client_for(settings: Settings) -> TransferClient:
    assert settings.api_url and settings.worker_key, "a remote worker needs FTQ_API_URL and FTQ_WORKER_KEY"
    tmp = settings.data_dir / "cache" / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return TransferClient(settings.api_url, settings.worker_key.get_secret_value(),
                          retries=settings.transfer_retries, tmp_dir=tmp)


# -- claims and registration ----------------------------------------------------------------


def may_claim(runtime: Runtime) -> bool:
    """A local worker always; a remote one while its key is good (not revoked) in the store."""
    settings = runtime.settings
    if not settings.remote_worker:
        return True
    from core.workers.keys import worker_key_active

    assert settings.worker_key is not None
    with runtime.sessionmaker.begin() as session:
        active = worker_key_active(session, settings.worker_key.get_secret_value())
    if active is None and runtime.worker_id not in _REFUSED:
        log.warning("worker %s claims nothing and stops beating: its FTQ_WORKER_KEY is revoked or unknown; ask "
                    "an admin for a new one (`ftq workers key create NAME`) and restart the worker", runtime.worker_id)
    (_REFUSED.add if active is None else _REFUSED.discard)(runtime.worker_id)
    return active is not None


_REFUSED: set[str] = set()
"""Workers of this process told that their key is refused (said once, not at every beat)."""


# -- datasets -------------------------------------------------------------------------------


def fetch_datasets(session: Session, settings: Settings, file_ids: list[str]) -> dict[str, str]:
    """file id → the cached download's path, for the ids the store still has (a deleted dataset
    is missing, as in ``core.files.service.paths_for``)."""
    from core.files.models import File

    rows = session.scalars(select(File).where(File.file_id.in_(file_ids))).all()
    if not rows:
        return {}
    with client_for(settings) as client:
        # A converted upload (ShareGPT, Alpaca) is stored as chat messages: its row's sha256 is the
        # original upload's, so the stored bytes are checked against the API's header alone.
        return {row.file_id: str(client.fetch_file(row.file_id, settings.cache_dir, sha256=_stored_sha256(row)))
                for row in rows}


def _stored_sha256(row: Any) -> str | None:
    """The sha256 of the bytes the API stores for a files row, when the row knows it."""
    return None if (row.stats or {}).get("converted_from") else row.sha256


@contextlib.contextmanager
def beating(runtime: Runtime, claim: Claim) -> Iterator[None]:
    """Keep the claimed job's heartbeat fresh for the whole run on a remote worker.

    The runner's watchdog beats only while the trainer runs; a remote worker also transfers
    before it (the datasets, the checkpoint a retry resumes from) and after it (the last
    checkpoints, job.json and the weights: tens of GB for ``method: full``), for longer than the
    reaper waits. This thread beats meanwhile, only while the job is still this claim's (a job
    another claim took is left alone: the runner finds it lost when it finishes). Local workers
    move nothing, so nothing runs for them.
    """
    if not runtime.settings.remote_worker:
        yield
        return
    from sqlalchemy import update

    from core.db import utcnow
    from core.jobs.models import Job

    stop = threading.Event()
    mine = ((Job.job_id == claim.job_id) & (Job.status == JobStatus.running.value)
            & (Job.worker_id == runtime.worker_id) & (Job.attempts == claim.attempt))

    def loop() -> None:
        while not stop.wait(runtime.settings.heartbeat_interval_s):
            try:
                with runtime.sessionmaker.begin() as session:
                    session.execute(update(Job).where(mine).values(heartbeat_at=utcnow())
                                    .execution_options(synchronize_session=False))
            except Exception as exc:  # noqa: BLE001 - the store is away: try again next interval
                log.warning("job %s: heartbeat during transfers failed: %s", claim.job_id, exc)

    thread = threading.Thread(target=loop, name=f"ftq-beat-{claim.job_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def run_failed(exc: Exception, attempt: int, max_attempts: int) -> Outcome:
    """The outcome of a run the worker itself could not carry out: a transfer that failed (the
    checkpoint a retry resumes from) is retried like a dataset download; anything else is the
    worker's own failure."""
    if isinstance(exc, TransferError):
        return not_prepared(exc, attempt, max_attempts)
    return Outcome(JobStatus.failed, "worker_error", f"the worker failed to run the job: {exc!r}")


def not_prepared(exc: Exception, attempt: int, max_attempts: int) -> Outcome:
    """The outcome of a job whose trainer config could not be built: a dataset download that
    failed (the API unreachable, a transfer cut or refused: this machine's key revoked) is
    retried, on this or another machine, until ``max_attempts``; a dataset the API no longer has,
    or a spec that no longer translates, fails the job."""
    if isinstance(exc, TransferError) and not isinstance(exc, TransferNotFound):
        message = f"the job's datasets could not be downloaded from the API: {exc}"
        if attempt < max_attempts:
            return Outcome(JobStatus.queued, "download_failed", f"{message}; retrying (attempt {attempt} of "
                           f"{max_attempts})", retry=True)
        return Outcome(JobStatus.failed, "download_failed", f"{message} (attempt {attempt} of {max_attempts}, "
                       "FTQ_MAX_ATTEMPTS); check that the worker machines reach FTQ_API_URL and their keys")
    if isinstance(exc, TransferNotFound) and exc.what.startswith("dataset "):
        return Outcome(JobStatus.failed, "invalid_job", f"{exc.what} of the job is gone from the API ({exc}); "
                       "upload the file again and resubmit the job with its new id")
    if isinstance(exc, TransferNotFound):  # not a checkpoint: fetch_recorded_checkpoint resumes without one
        return Outcome(JobStatus.failed, "invalid_job", f"{exc.what or 'an input'} of the job is gone from the API "
                       f"({exc}); resubmit the job once it is there again")
    return Outcome(JobStatus.failed, "invalid_job", f"the job could not be prepared for the trainer: {exc}")


# -- a job's checkpoints and outputs ----------------------------------------------------------


class LocalOutputs:
    """A local worker shares its disk with the API: every event is recorded as it comes."""

    def __init__(self, recorder: EventRecorder) -> None:
        self._recorder = recorder

    def add(self, event: dict[str, Any]) -> None:
        self._recorder.add(event)

    def drain(self) -> None:
        pass

    def finish(self, outcome: Outcome) -> Outcome:
        return outcome


class RemoteOutputs:
    """Uploads each checkpoint before its event is recorded; the final outputs at the end."""

    def __init__(self, client: TransferClient, claim: Claim, recorder: EventRecorder, *, max_attempts: int) -> None:
        self._client = client
        self._claim = claim
        self._recorder = recorder
        self._max_attempts = max_attempts
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"uploads-{claim.job_id}", daemon=True)
        self._thread.start()
        self.failed: list[str] = []
        """Checkpoints whose upload failed for good (their events were not recorded)."""

    def add(self, event: dict[str, Any]) -> None:
        if event.get("type") == "checkpoint" and self._claim.shared_home is None:
            self._queue.put(event)
        else:  # a checkpoint in the machines' shared directory is recorded where it is, not uploaded
            self._recorder.add(event)

    def _loop(self) -> None:
        while (event := self._queue.get()) is not None:
            try:
                name = layout.checkpoint_name(int(event["step"]))
                self._client.upload_artifact(self._claim.job_id, f"{layout.CHECKPOINTS}/{name}",
                                             layout.checkpoints_dir(self._claim.output_dir) / name)
            except (TransferError, KeyError, TypeError, ValueError, OSError) as exc:
                message = f"checkpoint {event.get('step')} was not uploaded, so it is not recorded: {exc}"
                log.warning("job %s: %s", self._claim.job_id, message)
                self.failed.append(str(event.get("step")))
                self._recorder.add({"type": "log", "level": "warning", "message": message})
            else:
                self._recorder.add(event)

    def drain(self) -> None:
        """Wait for the checkpoints queued so far (called once the trainer exited)."""
        self._queue.put(None)
        self._thread.join()

    def finish(self, outcome: Outcome) -> Outcome:
        """Upload job.json and the final weights of a succeeded run; a failure for good makes
        the attempt a retryable failure (the run resumes from its last uploaded checkpoint)."""
        if outcome.status is not JobStatus.succeeded:
            self._client.close()
            return outcome
        out = self._claim.output_dir
        try:
            self._client.upload_artifact(self._claim.job_id, "job.json", out / "job.json")
            for name in ("adapter", "model"):
                if (out / name).is_dir():
                    self._client.upload_artifact(self._claim.job_id, name, out / name)
        except TransferError as exc:
            message = f"the job trained, but its outputs could not be uploaded to the API: {exc}"
            log.warning("job %s: %s", self._claim.job_id, message)
            if self._claim.attempt < self._max_attempts:
                return Outcome(JobStatus.queued, "upload_failed", message, retry=True)
            return Outcome(JobStatus.failed, "upload_failed", message)
        finally:
            self._client.close()
        return outcome


def job_outputs(runtime: Runtime, claim: Claim, recorder: EventRecorder) -> LocalOutputs | RemoteOutputs:
    """The runner's handle on a job's checkpoint events and final outputs (see the module doc);
    on a remote worker, first fetches the newest recorded checkpoint if it is missing here."""
    settings = runtime.settings
    if not settings.remote_worker:
        return LocalOutputs(recorder)
    client = client_for(settings)
    try:
        fetch_recorded_checkpoint(runtime, claim, client)
    except BaseException:
        client.close()
        raise
    return RemoteOutputs(client, claim, recorder, max_attempts=settings.max_attempts)


def fetch_recorded_checkpoint(runtime: Runtime, claim: Claim, client: TransferClient) -> str | None:
    """Download the newest recorded checkpoint the API still has when this machine lacks it (the job
    ran elsewhere before); the name fetched, or None.

    A recorded checkpoint the API answers 404 for (its files were removed from the API's store, or
    it was written to a shared storage no machine here mounts and never uploaded) would be missing
    on every attempt: ending the attempt for it would fail the job for good although it can train.
    So the next older recorded checkpoint is tried, down to none (the trainer starts from step 0),
    and one ``log`` warning (``missing_checkpoints``, ``resume_step``) names each missing step and
    its recorded path and where the run resumes, so no progress is lost unsaid. The store keeps
    their rows: the steps re-trained record their checkpoints again over them.

    Raises:
        TransferError: a download failed for another reason (logged on the job too): the attempt
            ends and is retried (``run_failed``), rather than resuming from an older checkpoint,
            or from step 0, while the API holds a newer one (on a multi-machine job the ranks
            would even resume from different steps).
    """
    from core.jobs.models import Checkpoint

    with runtime.sessionmaker() as session:
        recorded = session.execute(select(Checkpoint.step, Checkpoint.path).where(Checkpoint.job_id == claim.job_id)
                                   .order_by(Checkpoint.step.desc())).all()
    missing: list[dict[str, Any]] = []
    fetched, resume_step = None, 0
    for step, path in recorded:
        name = layout.checkpoint_name(step)
        target = layout.checkpoints_dir(claim.checkpoint_home) / name
        if target.is_dir():
            resume_step = step
            break
        try:
            client.download_artifact(claim.job_id, f"{layout.CHECKPOINTS}/{name}", target)
        except TransferNotFound:
            missing.append({"step": step, "path": path})
            continue
        except TransferError as exc:
            _log_on_job(runtime, claim, f"could not fetch checkpoint {name} from the API ({exc}); this attempt "
                        "ends and is retried")
            raise
        log.info("job %s: fetched checkpoint %s from the API", claim.job_id, name)
        fetched, resume_step = name, step
        break
    if missing:
        _log_on_job(runtime, claim, _missing_message(runtime.worker_id, missing, resume_step),
                    missing_checkpoints=missing, resume_step=resume_step)
    return fetched


def _missing_message(worker_id: str, missing: list[dict[str, Any]], resume_step: int) -> str:
    """The ``log`` warning of a retry whose newest recorded checkpoint(s) the API does not have."""
    gone = "; ".join(f"step {c['step']} (recorded at {c['path'] or '?'})" for c in missing)
    newest = missing[0]["step"]
    where = (f"resuming from step {resume_step}, the newest recorded checkpoint the API has: steps "
             f"{resume_step + 1} to {newest} are trained again" if resume_step else
             f"the API has no recorded checkpoint, so training starts over from step 0: steps 1 to {newest} are "
             "trained again")
    one = len(missing) == 1
    return (f"{'checkpoint' if one else 'checkpoints'} {gone} {'is' if one else 'are'} neither on the API (404) "
            f"nor on {worker_id}: {where}. A checkpoint goes missing when its files were removed from the API's "
            "store, or when it was written to a shared storage (FTQ_SHARED_DIR) that no live worker mounts")


def _log_on_job(runtime: Runtime, claim: Claim, message: str, **fields: Any) -> None:
    """A ``log`` warning on the job's event stream (and this worker's log), published to viewers."""
    from core.jobs.service import append_events

    log.warning("job %s: %s", claim.job_id, message)
    with runtime.sessionmaker.begin() as session:
        (event,) = append_events(session, claim.job_id, [("log", {"level": "warning", "message": message, **fields})])
        seq = event.seq
    runtime.publish(claim.job_id, seq)


# -- exports --------------------------------------------------------------------------------


def export_inputs(settings: Settings, job: Job, export_id: str) -> tuple[Path, Path]:
    """``(job.json, export dir)`` on this machine: a remote worker fetches job.json (its
    ``output_dir`` pointed here) and the final weights if missing; a local one reads them in place."""
    from core.exports.service import EXPORTS_DIR, export_dir
    from trainer.config import TrainConfig

    if not settings.remote_worker:
        return Path(job.output_dir or ".") / "job.json", export_dir(job, export_id)
    job_dir = settings.jobs_dir / job.job_id
    with client_for(settings) as client:
        client.download_artifact(job.job_id, "job.json", job_dir / "job.json")
        config = dataclasses.replace(TrainConfig.load(job_dir / "job.json"), output_dir=str(job_dir))
        config.save(job_dir / "job.json")
        weights = layout.export_name(config.method)
        if not (job_dir / weights).is_dir():
            client.download_artifact(job.job_id, weights, job_dir / weights)
    return job_dir / "job.json", job_dir / EXPORTS_DIR / export_id


def upload_export(settings: Settings, job_id: str, export_id: str, out: Path) -> str | None:
    """Upload a finished export from a remote worker; the error message if that failed for good."""
    from core.exports.service import EXPORTS_DIR

    if not settings.remote_worker:
        return None
    try:
        with client_for(settings) as client:
            client.upload_artifact(job_id, f"{EXPORTS_DIR}/{export_id}", out)
    except (TransferError, OSError) as exc:  # the tar could not be written here, or the API refused it
        return f"the export was written but could not be uploaded to the API: {exc}"
    return None
