"""Resume of a job whose checkpoints its machines wrote into their shared checkpoint directory (a
Slurm job's, a multi-machine job's; nothing uploaded): the API host that mounts the same directory
(its ``FTQ_SHARED_DIR``) links the checkpoint into the new job's directory there and records it
there; one that mounts none answers 409 saying to mount it. A link in the shared directory is
followed for no resume (as for a download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.jobs.models import Checkpoint, Job
from core.jobs.states import JobStatus
from core.settings import Settings
from tests.integration.helpers import finish, spec, upload
from trainer.training import layout


@pytest.fixture
def settings(settings: Settings, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    (tmp_path / "shared").mkdir()
    mounted = getattr(request, "param", True)
    return settings.model_copy(update={"shared_dir": tmp_path / "shared" if mounted else None})


def _stopped_in_shared(client: TestClient, store, tmp_path: Path) -> tuple[str, Path]:
    """A cancelled job whose trainer ran elsewhere (``output_dir`` on its machine) and wrote
    checkpoints 2 and 4 into the shared directory; none is in the API's store."""
    job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
    shared_job = tmp_path / "shared" / "jobs" / job_id
    with store.sessions() as session:
        session.get(Job, job_id).output_dir = str(tmp_path / "bridge" / "jobs" / job_id)
        for step in (2, 4):
            ckpt = layout.checkpoint_dir(shared_job, step)
            ckpt.mkdir(parents=True)
            (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
            session.add(Checkpoint(job_id=job_id, step=step, path=str(ckpt), bytes=12, final=False))
        session.commit()
    finish(store, job_id, JobStatus.cancelled)
    return job_id, shared_job


def test_a_checkpoint_in_the_shared_directory_seeds_the_new_jobs_directory_there(
    client: TestClient, store, settings: Settings, tmp_path: Path
) -> None:
    source, shared_job = _stopped_in_shared(client, store, tmp_path)
    response = client.post(f"/v1/jobs/{source}/resume")
    assert response.status_code == 201, response.text
    new = response.json()["id"]
    seeded = layout.checkpoint_dir(tmp_path / "shared" / "jobs" / new, 4)
    (recorded,) = client.get(f"/v1/jobs/{new}/checkpoints").json()["data"]
    assert recorded["step"] == 4
    with store.sessions() as session:
        assert session.get(Checkpoint, (new, 4)).path == str(seeded)  # the trainer's home on Slurm
    state = seeded / "trainer_state.json"
    assert state.read_text() == '{"step": 4}'
    assert os.stat(state).st_ino == os.stat(layout.checkpoint_dir(shared_job, 4) / "trainer_state.json").st_ino
    assert not (settings.jobs_dir / new / layout.CHECKPOINTS).exists(), "nothing copied into the API's store"
    older = client.post(f"/v1/jobs/{source}/resume", json={"step": 2})
    assert older.status_code == 201, older.text
    assert layout.checkpoint_dir(tmp_path / "shared" / "jobs" / older.json()["id"], 2).is_dir()


def test_a_link_in_the_shared_directory_resumes_nothing(client: TestClient, store, tmp_path: Path) -> None:
    """The job's directory in the shared directory replaced by a link (any trainer on a machine
    that mounts it can do that) to another job's files: not read, as for a download."""
    source, shared_job = _stopped_in_shared(client, store, tmp_path)
    victim = tmp_path / "victim"
    shared_job.rename(victim)
    shared_job.symlink_to(victim, target_is_directory=True)
    refused = client.post(f"/v1/jobs/{source}/resume")
    assert refused.status_code == 409, refused.text
    assert "FTQ_SHARED_DIR" in refused.json()["error"]["message"]


@pytest.mark.parametrize("settings", [False], indirect=True)
def test_without_the_shared_directory_mounted_resume_says_to_mount_it(
    client: TestClient, store, tmp_path: Path
) -> None:
    source, shared_job = _stopped_in_shared(client, store, tmp_path)
    refused = client.post(f"/v1/jobs/{source}/resume")
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["param"] == "job_id"
    assert str(layout.checkpoint_dir(shared_job, 4)) in error["message"]
    assert "FTQ_SHARED_DIR is unset" in error["message"] and "mount that directory on the API host" in error["message"]
    chosen = client.post(f"/v1/jobs/{source}/resume", json={"step": 2})
    assert chosen.status_code == 409 and chosen.json()["error"]["param"] == "step", chosen.text
