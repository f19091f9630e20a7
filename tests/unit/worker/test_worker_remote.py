"""worker/remote.py: a remote worker's checkpoint events wait for their uploads; final outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.jobs.states import JobStatus
from core.settings import Settings
from worker.outcome import Outcome
from worker import remote
from worker.identity import default_address
from worker.remote import RemoteOutputs
from worker.runner import Claim
from worker.transfer import TransferError, TransferNotFound, TransferRefused


class FakeRecorder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)


class FakeClient:
    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.fail = fail
        self.uploads: list[tuple[str, str, Path]] = []
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def upload_artifact(self, job_id: str, path: str, source: Path) -> dict[str, Any]:
        if path in self.fail:
            raise TransferError(f"upload of {path} failed after 5 tries: 503")
        assert source.exists(), source
        self.uploads.append((job_id, path, source))
        return {}


def _claim(tmp_path: Path, attempt: int = 1) -> Claim:
    out = tmp_path / "job-1"
    for step in (2, 4):
        (out / "checkpoints" / f"step-00000{step}").mkdir(parents=True)
    (out / "adapter").mkdir()
    (out / "job.json").write_text("{}")
    return Claim(job_id="job-1", attempt=attempt, output_dir=out)


def test_a_checkpoint_is_recorded_only_after_its_upload(tmp_path):
    recorder, client = FakeRecorder(), FakeClient(fail={"checkpoints/step-000004"})
    outputs = RemoteOutputs(client, _claim(tmp_path), recorder, max_attempts=3)  # type: ignore[arg-type]
    outputs.add({"type": "step", "step": 1})
    outputs.add({"type": "checkpoint", "step": 2, "path": "x"})
    outputs.add({"type": "step", "step": 3})
    outputs.add({"type": "checkpoint", "step": 4, "path": "x"})
    outputs.drain()
    assert [p for _, p, _ in client.uploads] == ["checkpoints/step-000002"]
    kinds = [(e["type"], e.get("step")) for e in recorder.events]
    assert ("checkpoint", 2) in kinds and ("checkpoint", 4) not in kinds
    assert kinds.index(("step", 1)) < kinds.index(("checkpoint", 2))
    warning = [e for e in recorder.events if e["type"] == "log"]
    assert len(warning) == 1 and "checkpoint 4 was not uploaded" in warning[0]["message"]
    assert outputs.failed == ["4"]


def test_a_succeeded_run_uploads_job_json_and_the_adapter(tmp_path):
    client = FakeClient()
    outputs = RemoteOutputs(client, _claim(tmp_path), FakeRecorder(), max_attempts=3)  # type: ignore[arg-type]
    outputs.drain()
    done = Outcome(JobStatus.succeeded)
    assert outputs.finish(done) is done
    assert [p for _, p, _ in client.uploads] == ["job.json", "adapter"]
    assert client.closed


@pytest.mark.parametrize(("attempt", "status"), [(1, JobStatus.queued), (3, JobStatus.failed)])
def test_an_output_upload_that_fails_for_good_is_a_retryable_failure(tmp_path, attempt, status):
    client = FakeClient(fail={"adapter"})
    outputs = RemoteOutputs(client, _claim(tmp_path, attempt), FakeRecorder(), max_attempts=3)  # type: ignore[arg-type]
    outputs.drain()
    outcome = outputs.finish(Outcome(JobStatus.succeeded))
    assert outcome.status is status and outcome.error_code == "upload_failed"
    assert outcome.retry is (status is JobStatus.queued)
    assert "could not be uploaded" in (outcome.message or "")


def test_a_failed_run_uploads_nothing_at_the_end(tmp_path):
    client = FakeClient()
    outputs = RemoteOutputs(client, _claim(tmp_path), FakeRecorder(), max_attempts=3)  # type: ignore[arg-type]
    outputs.drain()
    failed = Outcome(JobStatus.failed, "trainer_crashed", "boom")
    assert outputs.finish(failed) is failed and client.uploads == []


def test_remote_settings_are_checked(tmp_path):
    Settings(data_dir=tmp_path).check_remote_worker()  # local: nothing to check
    with pytest.raises(ValueError, match="FTQ_API_URL"):
        Settings(data_dir=tmp_path, worker_key="ftqw_01234567_secret").check_remote_worker()
    with pytest.raises(ValueError, match="not a worker key"):
        Settings(data_dir=tmp_path, worker_key="ftq_01234567_secret", api_url="http://x:8000").check_remote_worker()
    ok = Settings(data_dir=tmp_path, worker_key="ftqw_01234567_secret", api_url="http://x:8000")
    ok.check_remote_worker()
    assert ok.remote_worker and ok.transfer_retries == 4 and ok.rdzv_port == 29400


def test_the_default_address_is_the_route_to_the_store(tmp_path):
    # the store on this machine (loopback): no address other machines could use, so none
    settings = Settings(data_dir=tmp_path, database_url="postgresql+psycopg://u@127.0.0.1:5432/ftq")
    assert default_address(settings) is None
    assert default_address(Settings(data_dir=tmp_path, worker_address="10.1.2.3")) is None  # no URL at all
    # a store elsewhere: the local end of the route to it (no packet sent; TEST-NET-1 is routable here
    # only through a default route, which a sandbox may lack)
    routed = default_address(Settings(data_dir=tmp_path, database_url="postgresql+psycopg://u@192.0.2.1:5432/ftq"))
    assert routed is None or not routed.startswith("127.")


@pytest.mark.parametrize(
    ("exc", "attempt", "status", "code"),
    [
        (TransferError("GET /v1/worker/files/file-1: connection refused"), 1, JobStatus.queued, "download_failed"),
        (TransferRefused("GET /v1/worker/files/file-1: 401 key revoked"), 2, JobStatus.queued, "download_failed"),
        (TransferError("GET /v1/worker/files/file-1: connection refused"), 3, JobStatus.failed, "download_failed"),
        (TransferNotFound("dataset file-1: not on the API (404)", "dataset file-1"), 1, JobStatus.failed,
         "invalid_job"),
        (TransferNotFound("adapter of job job-0: not on the API (404)", "adapter of job job-0"), 1, JobStatus.failed,
         "invalid_job"),
        (ValueError("hyperparameters.lr: must be positive"), 1, JobStatus.failed, "invalid_job"),
    ],
)
def test_a_dataset_download_that_fails_is_retried_a_gone_dataset_or_bad_spec_fails(exc, attempt, status, code):
    outcome = remote.not_prepared(exc, attempt, 3)
    assert (outcome.status, outcome.error_code) == (status, code)
    assert outcome.retry == (status is JobStatus.queued)
    assert str(exc) in (outcome.message or "")
    if isinstance(exc, TransferNotFound):  # it names what is gone, and says "dataset" only for one
        assert (outcome.message or "").startswith(f"{exc.what} of the job is gone from the API")
        assert ("dataset" in (outcome.message or "")) is exc.what.startswith("dataset")


def test_a_remote_workers_job_keeps_beating_through_its_transfers_and_only_while_it_is_this_claims(
        runtime, make_job, monkeypatch):
    import datetime as dt
    import time

    from sqlalchemy import update

    from core.db import utcnow
    from core.jobs.models import Job

    old = utcnow() - dt.timedelta(seconds=600)
    mine = make_job("fake:ok", status="running", attempts=1, worker_id=runtime.worker_id, heartbeat_at=old)
    taken = make_job("fake:ok", status="running", attempts=2, worker_id=runtime.worker_id, heartbeat_at=old)
    monkeypatch.setattr(type(runtime.settings), "remote_worker", property(lambda _self: True))
    with remote.beating(runtime, Claim(job_id=mine, attempt=1, output_dir=Path("/nonexistent"))), \
            remote.beating(runtime, Claim(job_id=taken, attempt=1, output_dir=Path("/nonexistent"))):
        time.sleep(4 * runtime.settings.heartbeat_interval_s)  # a long upload
    with runtime.sessionmaker() as session:
        beats = {job.job_id: job.heartbeat_at for job in session.query(Job).where(Job.job_id.in_([mine, taken]))}
    assert beats[mine] > old + dt.timedelta(seconds=590)
    assert beats[taken] == old  # attempt 2 is another claim's: not ours to keep alive
    with runtime.sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.job_id == mine).values(heartbeat_at=old))
    monkeypatch.setattr(type(runtime.settings), "remote_worker", property(lambda _self: False))
    with remote.beating(runtime, Claim(job_id=mine, attempt=1, output_dir=Path("/nonexistent"))):
        time.sleep(2 * runtime.settings.heartbeat_interval_s)  # a local worker moves nothing: no thread
    with runtime.sessionmaker() as session:
        assert session.get(Job, mine).heartbeat_at == old


def test_a_remote_worker_whose_key_is_revoked_stops_beating_so_its_machine_is_not_placed(runtime, monkeypatch):
    import datetime as dt

    from pydantic import SecretStr

    from core.db import utcnow
    from core.workers import keys
    from core.workers.models import Worker
    from worker.presence import register_heartbeat

    remote_settings = runtime.settings.model_copy(update={"worker_key": SecretStr("ftqw_0123abcd_x"),
                                                          "api_url": "http://api:8000"})
    monkeypatch.setattr(runtime, "settings", remote_settings)
    old = utcnow() - dt.timedelta(seconds=600)
    with runtime.sessionmaker.begin() as session:
        session.add(Worker(worker_id=runtime.worker_id, hostname="m", device="cpu", heartbeat_at=old))
    active: list[object] = [object()]
    monkeypatch.setattr(keys, "worker_key_active", lambda _session, _raw: active[0])
    register_heartbeat(runtime)
    with runtime.sessionmaker() as session:
        assert session.get(Worker, runtime.worker_id).heartbeat_at > old  # a good key: it beats
    with runtime.sessionmaker.begin() as session:
        session.get(Worker, runtime.worker_id).heartbeat_at = old
    active[0] = None  # revoked
    register_heartbeat(runtime)
    with runtime.sessionmaker() as session:
        assert session.get(Worker, runtime.worker_id).heartbeat_at == old


def test_a_retry_that_cannot_fetch_the_recorded_checkpoint_ends_its_attempt_instead_of_resuming_older(
        runtime, make_job, tmp_path):
    from core.jobs.models import Checkpoint, JobEvent

    job_id = make_job("fake:ok", status="running", attempts=2, worker_id=runtime.worker_id)
    with runtime.sessionmaker.begin() as session:
        session.add(Checkpoint(job_id=job_id, step=8, path="checkpoints/step-000008", bytes=1))

    class Down:
        def download_artifact(self, *_args):
            raise TransferError("GET checkpoints/step-000008: connection refused (5 tries)")

    claim = Claim(job_id=job_id, attempt=2, output_dir=tmp_path / job_id)
    (claim.output_dir / "checkpoints" / "step-000004").mkdir(parents=True)  # an older one is here
    with pytest.raises(TransferError):
        remote.fetch_recorded_checkpoint(runtime, claim, Down())
    with runtime.sessionmaker() as session:
        logged = [e.data["message"] for e in session.query(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "log")]
    assert any("could not fetch checkpoint step-000008" in m for m in logged)
    outcome = remote.run_failed(TransferError("connection refused"), 2, 3)
    assert (outcome.status, outcome.error_code, outcome.retry) == (JobStatus.queued, "download_failed", True)
    assert remote.run_failed(IsADirectoryError("x"), 1, 3).error_code == "worker_error"
