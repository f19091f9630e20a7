"""A remote worker's retry whose recorded checkpoint the API does not have (worker/remote.py
``fetch_recorded_checkpoint``), over the real path: the API served by uvicorn on a real store, a
worker with its own data directory and worker key claiming the job (worker/runner.py
``run_job``), its transfers made by worker/transfer.py, the fake trainer in place of the real one.

A 404 for the checkpoint to resume from is no reason to lose the job (it can train): the worker
resumes from the newest recorded checkpoint the API has, or from step 0, and says so in a ``log``
event naming the missing step and its path. A 404 for a dataset still fails the job, naming it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import update

from core.jobs.models import Checkpoint, Job, JobEvent
from core.settings import Settings
from tests.fixtures.worker_runtime import FAKE_TRAINER, FakeBuilder
from tests.integration.helpers import make_worker_key, serve, spec, upload
from worker.runner import run_job
from worker.runtime import Runtime, WorkerOptions

pytestmark = pytest.mark.integration


def _retry(client, store, settings: Settings, steps: dict[int, bool]) -> str:
    """A queued job on its second attempt whose store records a checkpoint at each of ``steps``;
    those mapped to True are in the API's artifact store, the others are not."""
    job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
    with store.sessions.begin() as session:
        session.execute(update(Job).where(Job.job_id == job_id).values(model="fake:ok", attempts=1))
        for step, on_api in steps.items():
            path = settings.jobs_dir / job_id / "checkpoints" / f"step-{step:06d}"
            session.add(Checkpoint(job_id=job_id, step=step, path=str(path), bytes=5))
            if on_api:
                path.mkdir(parents=True)
                (path / "state.json").write_text(f'{{"step": {step}}}')
    return job_id


def _remote_worker(store, settings: Settings, url: str, tmp_path: Path) -> Runtime:
    """A worker of another machine: its own data directory, a worker key, the API at ``url``."""
    worker_settings = Settings(data_dir=tmp_path / "box-2", database_url=store.url, api_url=url,
                               worker_key=SecretStr(make_worker_key(store, "box-2")), heartbeat_interval_s=0.2,
                               event_flush_interval_s=0.05, max_attempts=3, transfer_retries=0).resolved()
    worker_settings.data_dir.mkdir(parents=True)
    rt = Runtime(worker_settings, WorkerOptions(name="w@box-2", trainer_argv=(sys.executable, str(FAKE_TRAINER))),
                 engine=store.engine, sessionmaker=store.sessions, config_builder=FakeBuilder())
    rt.enqueue = lambda job_id, host=None: None  # type: ignore[method-assign]
    rt.publish = lambda job_id, seq: None  # type: ignore[method-assign]
    return rt


def _warnings(store, job_id: str) -> list[dict]:
    with store.sessions() as session:
        return [e.data for e in session.query(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "log")
                .order_by(JobEvent.seq) if e.data.get("missing_checkpoints")]


@pytest.mark.parametrize(("steps", "resume_step"), [({2: True, 4: False}, 2), ({2: False, 4: False}, 0)],
                         ids=["an-older-one-is-there", "none-is-there"])
def test_a_retry_whose_checkpoint_the_api_lacks_resumes_from_what_is_there_and_says_so(
        client, store, settings: Settings, tmp_path: Path, steps: dict[int, bool], resume_step: int) -> None:
    job_id = _retry(client, store, settings, steps)
    with serve(settings) as server:
        worker = _remote_worker(store, settings, server.url, tmp_path)
        assert run_job(worker, job_id) == "succeeded"
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job
    fetched = worker.settings.jobs_dir / job_id / "checkpoints"
    assert sorted(p.name for p in fetched.iterdir()) == (["step-000002"] if resume_step else [])
    (warning,) = _warnings(store, job_id)
    missing = [step for step, on_api in sorted(steps.items(), reverse=True) if not on_api]
    assert [c["step"] for c in warning["missing_checkpoints"]] == missing
    assert warning["missing_checkpoints"][0]["path"] == str(settings.jobs_dir / job_id / "checkpoints/step-000004")
    assert warning["resume_step"] == resume_step and warning["level"] == "warning"
    message = warning["message"]
    assert "step 4 (recorded at " in message and "neither on the API (404) nor on w@box-2" in message
    assert "dataset" not in message
    assert (f"resuming from step {resume_step}" if resume_step else "starts over from step 0") in message


def test_a_retry_whose_dataset_the_api_lacks_fails_naming_the_file(
        client, store, settings: Settings, tmp_path: Path) -> None:
    job_id = _retry(client, store, settings, {2: True})
    from core.files.models import File

    file_id = client.get(f"/v1/jobs/{job_id}").json()["training_file"]
    with store.sessions() as session:
        Path(session.get(File, file_id).path).unlink()  # the API's bytes are gone, its row stays
    with serve(settings) as server:
        worker = _remote_worker(store, settings, server.url, tmp_path)
        worker.config_builder = None  # the real builder: the datasets come from the API
        assert run_job(worker, job_id) == "failed"
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["error"]["code"] == "invalid_job", job
    assert f"dataset {file_id} of the job is gone from the API" in job["error"]["message"]
