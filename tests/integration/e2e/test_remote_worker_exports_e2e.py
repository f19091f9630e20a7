"""An export of a job that trained on a remote worker runs on that worker, end to end.

The stack is ``remote_stack`` of test_remote_worker_e2e.py (its own instance here): the API and a
worker with a worker key and an empty data directory of its own, sharing only PostgreSQL and
Redis. The job trains there; the worker's copy of the job's files is then removed, so the export
must download job.json and the adapter from the API (``/v1/worker/jobs/.../artifacts``), merge on
the worker's CPU, and upload ``exports/<id>`` before it is ``succeeded``; the user's API serves
the worker's bytes. An export whose upload is refused (the key revoked while the export process
runs), or whose downloads are (the key revoked before it starts), ends ``failed`` saying why.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.e2e_stacks import KEY_NAME
from tests.fixtures.exports import wait_export
from tests.fixtures.processes import pids_where
from tests.fixtures.stack import Stack
from tests.fixtures.stack_jobs import SHORT, submit, upload, wait_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(remote_stack: Stack, chat_dataset: Path) -> dict[str, Any]:
    """A LoRA job of the tiny model that succeeded on the remote worker."""
    with remote_stack.client() as client:
        job = submit(client, upload(client, chat_dataset), hyperparameters={**SHORT, "max_steps": 4}, name="to-export")
        done = wait_job(client, job["id"], lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
                        what="finished", timeout_s=300)
    assert done["status"] == "succeeded", f"{done}\n{remote_stack.log_tail()}"
    return done


def _dirs(stack: Stack, job_id: str) -> tuple[Path, Path]:
    """The job's directory in the API's artifact store and on the worker machine."""
    return stack.data_dir / "jobs" / job_id, stack.data_dir.parent / "worker-data" / "jobs" / job_id


def _tree_digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _ask_merged(client: httpx.Client, job_id: str) -> str:
    asked = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "merged"})
    assert asked.status_code == 202, asked.text
    return str(asked.json()["id"])


def test_an_export_runs_on_the_remote_worker_from_downloads_and_is_served_by_the_api(
    remote_stack, trained
):
    stack, job_id = remote_stack, trained["id"]
    api_job, worker_job = _dirs(stack, job_id)
    # This machine keeps nothing of the job: what the export reads must come down from the API.
    shutil.rmtree(worker_job)
    with stack.client() as client:
        export_id = _ask_merged(client, job_id)
        export = wait_export(client, job_id, export_id)
        assert export["status"] == "succeeded", f"{export}\n{stack.log_tail()}"
        assert export["download_url"] == f"/v1/jobs/{job_id}/exports/{export_id}/download"
        served = client.get(export["download_url"])
    assert served.status_code == 200, served.text
    # job.json and the adapter came down (job.json pointed at this machine's directory).
    assert _tree_digests(worker_job / "adapter") == _tree_digests(api_job / "adapter")
    assert (worker_job / "job.json").is_file()
    # What the worker made went up whole, and the user's API serves exactly those bytes.
    made = _tree_digests(worker_job / "exports" / export_id)
    assert "model.safetensors" in made and "config.json" in made, made
    assert _tree_digests(api_job / "exports" / export_id) == made
    with zipfile.ZipFile(io.BytesIO(served.content)) as archive:
        names = sorted(n for n in archive.namelist() if not n.endswith("/"))
        assert names == sorted(made), names
        for name in names:
            assert archive.read(name) == (worker_job / "exports" / export_id / name).read_bytes(), name
    assert export["bytes"] == sum((worker_job / "exports" / export_id / n).stat().st_size for n in made)


@contextmanager
def _paused(pid: int) -> Iterator[None]:
    """SIGSTOP the process for the block, SIGCONT after (it belongs to this test's worker)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _export_process(stack: Stack, export_id: str, timeout_s: float = 120) -> int:
    """The pid of the worker's export process of ``export_id``: it starts only once the export's
    downloads are done (``worker.exports.run_export``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in pids_where(lambda argv: b"export" in argv and any(export_id.encode() in arg for arg in argv)):
            return pid
        time.sleep(0.02)
    raise AssertionError(f"the export process of {export_id} never started\n{stack.log_tail()}")


def test_an_export_whose_upload_is_refused_fails_saying_why(remote_stack, trained):
    """The key is revoked while the export process runs (it is paused meanwhile, so the revocation
    lands after the downloads and before the upload): the export ends failed, not running."""
    stack, job_id = remote_stack, trained["id"]
    with stack.client() as client:
        export_id = _ask_merged(client, job_id)
        with _paused(_export_process(stack, export_id)):
            assert client.get(f"/v1/jobs/{job_id}/exports/{export_id}").json()["status"] == "running"
            revoked = client.delete(f"/v1/workers/keys/{KEY_NAME}")
            assert revoked.status_code == 200, revoked.text
        export = wait_export(client, job_id, export_id)
        assert export["status"] == "failed", f"{export}\n{stack.log_tail()}"
        assert export["error_code"] == "upload_failed", export
        assert "could not be uploaded to the API" in export["error_message"], export
        assert "FTQ_WORKER_KEY" in export["error_message"], export
        assert export["download_url"] is None
        refused = client.get(f"/v1/jobs/{job_id}/exports/{export_id}/download")
    assert refused.status_code == 409, refused.text
    _, worker_job = _dirs(stack, job_id)
    assert (worker_job / "exports" / export_id / "model.safetensors").is_file(), "the export itself was written"
    assert not (stack.data_dir / "jobs" / job_id / "exports" / export_id).exists(), "nothing half-uploaded is kept"


def test_an_export_whose_downloads_are_refused_fails_saying_why(remote_stack, trained):
    """With the key already revoked (by the test above, or here), the export cannot fetch the
    job's files: it ends failed with the refusal, not stuck running."""
    stack, job_id = remote_stack, trained["id"]
    with stack.client() as client:
        assert client.delete(f"/v1/workers/keys/{KEY_NAME}").status_code == 200  # idempotent
        export = wait_export(client, job_id, _ask_merged(client, job_id))
    assert export["status"] == "failed", f"{export}\n{stack.log_tail()}"
    assert export["error_code"] == "download_failed", export
    assert "refused this worker" in export["error_message"] and "FTQ_WORKER_KEY" in export["error_message"], export
