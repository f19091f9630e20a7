"""The ``exports.run`` task: one export of a finished job, run by the host that holds its files.

    claim     queued → running by compare-and-set (a redelivered message finds it taken); an
              export this host left ``running`` when it was restarted is failed first
    run       ``<trainer> export job.json --format F --out <output_dir>/exports/<id> --device cpu``
              in its own session; its ``progress`` events update the row (at most one store
              write a second, and at each new stage) and the job's event history
    finish    the ``done`` event (or the exit code and stderr tail) becomes succeeded | failed

Exports run on the CPU: the host's GPUs belong to the training jobs the scheduler reserved them
for, and merging is memory-bound (an 8B merge and GGUF write take minutes there, see
``bench/export.py``). The worker has one thread more than GPUs (``worker/app.py``); one export
runs at a time per host (``ExportSlot``), a second waits in the broker (retried every
``RETRY_S``) instead of holding a thread a job could need.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.exports import service
from core.exports.models import Export
from core.jobs.models import Job
from core.queue import TASK_EXPORT
from trainer.events import parse_line
from worker import remote
from worker.transfer import TransferError, TransferNotFound

if TYPE_CHECKING:
    from worker.runtime import Runtime

log = logging.getLogger(__name__)

RETRY_S = 5.0
PROGRESS_EVERY_S = 1.0


class ExportSlot:
    """One export at a time in this worker process; knows which one (to spot stale rows)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: str | None = None

    def try_take(self, export_id: str) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        self.current = export_id
        return True

    def release(self) -> None:
        self.current = None
        self._lock.release()


def register_export_task(app: Any, runtime_of: Any) -> None:
    """Define ``exports.run`` on ``app``."""
    slot = ExportSlot()

    @app.task(name=TASK_EXPORT, bind=True, ignore_result=True, shared=False, max_retries=None)
    def run(task: Any, export_id: str) -> str:
        if not slot.try_take(export_id):
            raise task.retry(countdown=RETRY_S)
        try:
            return run_export(runtime_of(), export_id)
        finally:
            slot.release()


def run_export(runtime: Runtime, export_id: str) -> str:
    """Claim and run one export; returns its final status, or ``skipped`` if it was not queued."""
    with runtime.sessionmaker.begin() as session:
        _fail_stale(session, runtime.worker_id, export_id)
        export = service.claim(session, export_id, runtime.worker_id)
        if export is None:
            return "skipped"
        job = session.get(Job, export.job_id)
        assert job is not None, f"export {export_id}: job {export.job_id} vanished"
        fmt, quantization = export.format, export.quantization
        job_id, seq = job.job_id, service.last_seq(session, job.job_id)
        session.expunge(job)
    runtime.publish(job_id, seq)
    try:
        job_json, out = remote.export_inputs(runtime.settings, job, export_id)  # a remote worker downloads them
    except (TransferError, OSError, ValueError, KeyError, TypeError) as exc:  # never left running
        code = "not_found" if isinstance(exc, TransferNotFound) else "download_failed"
        return _finish(runtime, export_id, job_id, dict(path=None, size=None, error_code=code,
                       message=f"could not fetch the job's job.json and weights from the API: {exc}"))
    argv = [*runtime.options.trainer_argv, "export", str(job_json), "--format", fmt, "--out", str(out), "--device", "cpu"]
    if quantization:
        argv += ["--quantization", quantization]
    log.info("export %s of job %s: %s", export_id, job_id, " ".join(argv))
    done, stderr_tail, code = _run(runtime, export_id, job_id, argv, out.parent)
    failed_upload = remote.upload_export(runtime.settings, job_id, export_id, out) if _succeeded(done) else None
    if failed_upload:
        result = dict(path=None, size=None, error_code="upload_failed", message=failed_upload)
    elif done is not None and done.get("status") == "succeeded":
        result = dict(path=str(out), size=int(done.get("bytes") or 0))
    elif done is not None:
        result = dict(path=None, size=None, error_code=done.get("error_code") or "export_error",
                      message=done.get("message"))
    else:
        result = dict(path=None, size=None, error_code="crashed",
                      message=f"the export process exited with code {code} without a result: " + " | ".join(stderr_tail))
    return _finish(runtime, export_id, job_id, result)


def _succeeded(done: dict[str, Any] | None) -> bool:
    return done is not None and done.get("status") == "succeeded"


def _finish(runtime: Runtime, export_id: str, job_id: str, result: dict[str, Any]) -> str:
    with runtime.sessionmaker.begin() as session:
        finished = service.finish(session, export_id, **result)
        seq = service.last_seq(session, job_id)
    runtime.publish(job_id, seq)
    return finished.status if finished is not None else "lost"


def _run(runtime: Runtime, export_id: str, job_id: str, argv: list[str],
         cwd: Path) -> tuple[dict[str, Any] | None, list[str], int]:
    """Run the export process, recording its progress; returns (done event, stderr tail, exit code)."""
    from worker.launch import trainer_env

    env = trainer_env(runtime, devices=())
    env["CUDA_VISIBLE_DEVICES"] = ""
    cwd.mkdir(parents=True, exist_ok=True)
    stderr_path = cwd / f"{export_id}.stderr.log"
    done: dict[str, Any] | None = None
    last = (None, 0.0)
    with stderr_path.open("wb") as stderr:
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd,
                              start_new_session=True) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                event = parse_line(line)
                if event is None:
                    continue
                if event["type"] == "done":
                    done = event
                elif event["type"] == "progress":
                    stage, now = event.get("stage"), time.monotonic()
                    if stage != last[0] or now - last[1] >= PROGRESS_EVERY_S or event.get("fraction") == 1.0:
                        _progress(runtime, export_id, job_id, str(stage), float(event.get("fraction") or 0.0))
                        last = (stage, now)
        code = proc.returncode
    tail = deque(stderr_path.read_text(errors="replace").splitlines(), maxlen=5)
    return done, list(tail), code


def _progress(runtime: Runtime, export_id: str, job_id: str, stage: str, fraction: float) -> None:
    try:
        with runtime.sessionmaker.begin() as session:
            service.record_progress(session, export_id, stage, fraction)
            seq = service.last_seq(session, job_id)
        runtime.publish(job_id, seq)
    except Exception as exc:  # noqa: BLE001 - progress is best effort; the final state is not
        log.warning("export %s: could not record progress: %s", export_id, exc)


def _fail_stale(session: Any, worker_id: str, current: str) -> None:
    """Exports this host shows ``running`` but does not run: this worker process was restarted
    mid-export (only one export runs per host, and it is ``current``)."""
    from sqlalchemy import select

    stale = session.scalars(select(Export.export_id).where(
        Export.worker_id == worker_id, Export.status == "running", Export.export_id != current)).all()
    for export_id in stale:
        service.finish(session, export_id, path=None, size=None, error_code="worker_lost",
                       message=f"worker {worker_id} restarted while it ran this export; ask for it again")
    if stale:
        log.warning("failed %d exports left running by an earlier run of this worker: %s", len(stale), stale)
