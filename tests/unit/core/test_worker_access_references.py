"""A worker key reaches another job's weights only while a session, generation job or eval run that
names exactly those weights runs on one of its workers, and only within the running job's project;
a generation output is uploaded only for a generation job or an eval run."""

from __future__ import annotations

import pytest

from core.db import new_id, utcnow
from core.errors import Forbidden, InvalidInput
from core.exports.models import Export
from core.files.models import File
from core.jobs.models import Job
from core.projects.models import Project
from core.workers.access import check_file_access, check_job_access
from core.workers.keys import create_worker_key
from core.workers.models import Worker
from core.workers.uploads import check_upload


def _worker(session, name: str) -> str:
    key, _raw = create_worker_key(session, f"key-{name}", created_by=None)
    session.flush()
    now = utcnow()
    session.add(Worker(worker_id=name, hostname=name, device="cpu", started_at=now, heartbeat_at=now,
                       key_id=key.worker_key_id))
    session.flush()
    return key.worker_key_id


def _job(session, *, kind: str = "train", status: str = "succeeded", spec: dict | None = None,
         project: str | None = None, worker: str | None = None, method: str = "lora",
         file_id: str | None = None) -> str:
    job_id = new_id("job")
    now = utcnow()
    session.add(Job(job_id=job_id, kind=kind, model="tiny", method=method, spec=spec or {}, training_file_id=file_id,
                    status=status, project_id=project, worker_id=worker, created_at=now, updated_at=now))
    session.flush()
    return job_id


@pytest.fixture
def world(box):
    """Two keys' workers, projects a and b, and a succeeded training job of project a."""
    maker, _settings = box
    session = maker()
    session.add_all([Project(project_id="a", name="a"), Project(project_id="b", name="b")])
    session.flush()
    keys = {"mine": _worker(session, "gpubox2"), "other": _worker(session, "gpubox3")}
    trained = _job(session, project="a")
    yield session, keys, trained
    session.close()


def _may_read(session, key_id: str, job_id: str, path: str) -> bool:
    try:
        check_job_access(session, key_id, job_id, path, upload=False)
    except Forbidden:
        return False
    return True


@pytest.mark.parametrize("model, allowed", [
    ("job:{t}", "adapter"),
    ("job:{t}@10", "checkpoints/step-000010"),
])
def test_a_running_generation_job_opens_exactly_the_weights_it_names(world, model: str, allowed: str):
    session, keys, trained = world
    _job(session, kind="generate", status="running", spec={"model": model.format(t=trained)}, project="a",
         worker="gpubox2")
    paths = ("adapter", "checkpoints/step-000010", "checkpoints/step-000020", "job.json", "model")
    assert [p for p in paths if _may_read(session, keys["mine"], trained, p)] == [allowed]
    assert not _may_read(session, keys["other"], trained, allowed)  # another machine's key: nothing
    with pytest.raises(Forbidden):
        check_job_access(session, keys["mine"], trained, allowed, upload=True)


def test_a_session_opens_each_of_its_models_and_an_export_opens_only_itself(world):
    session, keys, trained = world
    second = _job(session, project="a", method="full")
    session.add_all([Export(export_id="exp-01", job_id=trained, format="merged", status="succeeded", project_id="a"),
                     Export(export_id="exp-02", job_id=trained, format="merged", status="succeeded", project_id="a")])
    session.flush()
    _job(session, kind="session", status="running", spec={"models": [f"job:{trained}", f"job:{second}"]},
         project="a", worker="gpubox2")
    _job(session, kind="eval", status="running", spec={"model": "export:exp-01"}, project="a", worker="gpubox2")
    assert _may_read(session, keys["mine"], trained, "adapter")
    assert _may_read(session, keys["mine"], second, "model") and not _may_read(session, keys["mine"], second, "adapter")
    assert _may_read(session, keys["mine"], trained, "exports/exp-01")
    assert not _may_read(session, keys["mine"], trained, "exports/exp-02")


def test_nothing_opens_once_the_job_ends_nor_across_projects(world):
    session, keys, trained = world
    ended = _job(session, kind="generate", status="succeeded", spec={"model": f"job:{trained}"}, project="a",
                 worker="gpubox2")
    assert not _may_read(session, keys["mine"], trained, "adapter")
    session.get(Job, ended).status = "running"
    session.get(Job, ended).project_id = "b"  # a spec naming another project's job (never admitted): refused
    session.flush()
    assert not _may_read(session, keys["mine"], trained, "adapter")


def test_the_prompts_file_comes_down_and_only_generations_upload_completions(world):
    session, keys, trained = world
    session.add(File(file_id="file-p", filename="p.jsonl", purpose="generate", bytes=1, sha256="0" * 64,
                     format="prompts", num_records=1, path="/dev/null", stats={}, created_at=utcnow()))
    session.flush()
    gen = _job(session, kind="generate", status="running", spec={"model": "tiny"}, project="a", worker="gpubox2",
               file_id="file-p")
    assert check_file_access(session, keys["mine"], "file-p").file_id == "file-p"
    with pytest.raises(Forbidden):
        check_file_access(session, keys["other"], "file-p")
    for path in ("completions.jsonl", "completions.parts"):
        check_upload(session, session.get(Job, gen), path)
        with pytest.raises(InvalidInput, match="generation job's output"):
            check_upload(session, session.get(Job, trained), path)


def test_the_sweep_drops_uploaded_parts_once_completions_hold_every_line(world, box):
    from core.jobs import artifact_store
    from core.jobs.states import JobStatus
    from core.workers.uploads import sweep_job

    session, _keys, _trained = world
    _maker, settings = box
    done, cancelled = (_job(session, kind="generate", status=status, spec={"model": "tiny"})
                       for status in ("succeeded", "cancelled"))
    session.commit()
    for job_id in (done, cancelled):
        parts = artifact_store.job_store_dir(settings, job_id) / "completions.parts"
        parts.mkdir(parents=True)
        (parts / "rank-0.jsonl").write_text('{"index": 0}\n')
    (artifact_store.job_store_dir(settings, done) / "completions.jsonl").write_text('{"index": 0}\n')
    assert sweep_job(session, settings, done, JobStatus.succeeded) == [
        artifact_store.job_store_dir(settings, done) / "completions.parts"]
    assert sweep_job(session, settings, cancelled, JobStatus.cancelled) == []  # a resume starts from them
    assert (artifact_store.job_store_dir(settings, cancelled) / "completions.parts" / "rank-0.jsonl").is_file()
