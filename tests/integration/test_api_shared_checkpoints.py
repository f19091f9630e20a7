"""Checkpoint downloads of a job whose machines wrote them into their shared checkpoint directory
(``shared_checkpoint_dir``; nothing uploaded): served when the API host mounts the same directory
(its own ``FTQ_SHARED_DIR``, the path computed by the API), else 409 naming where it lives; a
checkpoint of the job's own ``output_dir`` missing from the store is still the 404 it was."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.jobs.models import Checkpoint, Job
from core.settings import Settings
from tests.integration.helpers import spec, upload


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    (tmp_path / "shared").mkdir()
    return settings.model_copy(update={"shared_dir": tmp_path / "shared"})


def _job_with_checkpoints(client: TestClient, store, tmp_path: Path) -> tuple[str, Path]:
    """A job run by a remote leader (``output_dir`` on its own disk) whose checkpoints 4 and 5 are
    in a shared directory and 6 under its own ``output_dir``; none is in the API's store."""
    job_id = client.post("/v1/jobs", json=spec(upload(client), method="full", gpus=2)).json()["id"]
    machine = tmp_path / "m1" / "jobs" / job_id
    shared = tmp_path / "shared" / "jobs" / job_id / "checkpoints"
    with store.sessions() as session:
        session.get(Job, job_id).output_dir = str(machine)
        for step, where in ((4, shared), (5, shared), (6, machine / "checkpoints")):
            session.add(Checkpoint(job_id=job_id, step=step, path=str(where / f"step-{step:06d}"), bytes=1))
        session.commit()
    return job_id, shared


def test_a_shared_checkpoint_is_served_from_the_api_hosts_mount_or_refused_saying_where(
    client: TestClient, store, tmp_path: Path
) -> None:
    job_id, shared = _job_with_checkpoints(client, store, tmp_path)
    (shared / "step-000004" / "dcp").mkdir(parents=True)
    (shared / "step-000004" / "dcp" / "__0_0.distcp").write_bytes(b"rank 0's shard")
    (shared / "step-000004" / "trainer_state.json").write_text('{"step": 4}')

    served = client.get(f"/v1/jobs/{job_id}/checkpoints/4/download")
    assert served.status_code == 200, served.text
    with zipfile.ZipFile(io.BytesIO(served.content)) as archive:
        assert sorted(archive.namelist()) == ["dcp/__0_0.distcp", "trainer_state.json"]
        assert archive.read("dcp/__0_0.distcp") == b"rank 0's shard"

    elsewhere = client.get(f"/v1/jobs/{job_id}/checkpoints/5/download")  # not in the API host's mount
    assert elsewhere.status_code == 409, elsewhere.text
    error = elsewhere.json()["error"]
    assert error["param"] == "step" and "shared checkpoint directory" in error["message"]
    assert str(shared / "step-000005") in error["message"] and "FTQ_SHARED_DIR" in error["message"]

    lost = client.get(f"/v1/jobs/{job_id}/checkpoints/6/download")  # uploaded once, gone from the store
    assert lost.status_code == 404, lost.text


def test_a_link_in_the_shared_directory_serves_nothing_of_another_job(client: TestClient, store, tmp_path: Path) -> None:
    """A trainer on a machine that mounts the shared directory replaced its job's directory there by
    a link to another job's directory in the API's store: the download follows nothing (the
    containment check would follow the link too) and answers as for a checkpoint not in the mount."""
    job_id, shared = _job_with_checkpoints(client, store, tmp_path)
    victim = tmp_path / "victim-job"
    (victim / "checkpoints" / "step-000004").mkdir(parents=True)
    (victim / "checkpoints" / "step-000004" / "secret.bin").write_bytes(b"another project's weights")
    job_dir = shared.parent
    job_dir.parent.mkdir(parents=True, exist_ok=True)
    job_dir.symlink_to(victim, target_is_directory=True)
    refused = client.get(f"/v1/jobs/{job_id}/checkpoints/4/download")
    assert refused.status_code == 409 and b"another project" not in refused.content, refused.text
