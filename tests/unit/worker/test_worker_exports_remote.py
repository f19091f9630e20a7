"""worker/exports.py on a remote worker: an export whose inputs cannot come down, or whose output
cannot go up, ends ``failed`` saying why, never left ``running``. (The end-to-end path, a real
API and a key revoked mid-export: tests/integration/e2e/test_remote_worker_exports_e2e.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from core.exports.models import Export
from tests.fixtures.worker_runtime import queued_export
from worker import remote, transfer
from worker.exports import run_export
from worker.runtime import Runtime
from worker.transfer import TransferNotFound, TransferRefused


def _row(runtime: Runtime, export_id: str) -> Export:
    with runtime.sessionmaker() as session:
        return session.get(Export, export_id)


@pytest.mark.parametrize(
    ("error", "code", "says"),
    [
        (TransferRefused("job.json of job x: the API refused this worker (401: revoked)"), "download_failed",
         "refused this worker"),
        (TransferNotFound("adapter of job x: not on the API (404: gone)"), "not_found", "not on the API"),
        (ValueError("job.json: Expecting value: line 1 column 1"), "download_failed", "Expecting value"),
        (OSError(28, "No space left on device"), "download_failed", "No space left"),
    ],
)
def test_an_export_whose_inputs_cannot_come_down_fails_saying_why(
    export_runtime: Runtime, make_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    error: Exception, code: str, says: str,
) -> None:
    _, export_id = queued_export(export_runtime, make_job, "ok", tmp_path)

    def refuse(*_: object) -> None:
        raise error

    monkeypatch.setattr(remote, "export_inputs", refuse)
    assert run_export(export_runtime, export_id) == "failed"
    row = _row(export_runtime, export_id)
    assert row.error_code == code and says in row.error_message, (row.error_code, row.error_message)
    assert row.error_message.startswith("could not fetch the job's job.json and weights from the API")


def test_an_export_whose_archive_cannot_be_written_fails_as_upload_failed(
    export_runtime: Runtime, make_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """A full disk while the upload's tar is written (an OSError, not a TransferError)."""
    job_id, export_id = queued_export(export_runtime, make_job, "ok", tmp_path)
    export_runtime.settings = export_runtime.settings.model_copy(
        update={"worker_key": SecretStr("ftqw_0123abcd_secret"), "api_url": "http://127.0.0.1:9"})
    out = tmp_path / "job-out"
    monkeypatch.setattr(remote, "export_inputs", lambda *_: (out / "job.json", out / "exports" / export_id))

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transfer.tars, "write_tar", full_disk)
    assert run_export(export_runtime, export_id) == "failed"
    row = _row(export_runtime, export_id)
    assert row.error_code == "upload_failed" and "No space left on device" in row.error_message, row.error_message
    assert (out / "exports" / export_id / "model.safetensors").is_file(), "the export itself ran"
