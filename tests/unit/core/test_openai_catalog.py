"""``core.openai.catalog`` on a SQLite store: a tuned model's name is the job object's and parses
back to its job (a native job's name may hold ``:``), checkpoints are named after it, bases come
from the model root with their folders, and a name that is not the job's exactly is unknown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core.db import new_id, utcnow
from core.errors import NotFound
from core.files.models import File
from core.jobs.models import Checkpoint, Job
from core.openai.catalog import ORGANIZATION, checkpoint_model, fine_tuned_model, get_model, list_models
from core.settings import Settings
from core.users import service as users
from core.users.service import Caller


def _openai_caller(session: Session, name: str) -> Caller:
    """The caller as ``/openai/v1`` sees them (``api.auth.authenticate_openai``)."""
    caller = users.caller_of(session, users.create_user(session, name))
    return dataclasses.replace(caller, project_ids=frozenset({caller.project_id}), per_owner=True)


def _job(session: Session, caller: Caller, *, name: str | None, status: str = "succeeded",
         steps: tuple[int, ...] = ()) -> Job:
    file_id = new_id("file")
    session.add(File(file_id=file_id, filename="t.jsonl", purpose="train", bytes=1, sha256="0" * 64, format="chat",
                     num_records=1, path="/x", owner_id=caller.user_id, project_id=caller.project_id,
                     created_at=utcnow()))
    job = Job(job_id=new_id("job"), status=status, model="tiny", method="lora", spec={}, name=name,
              training_file_id=file_id, owner_id=caller.user_id, project_id=caller.project_id,
              output_dir="/x", finished_at=utcnow() if status == "succeeded" else None)
    session.add(job)
    session.flush()
    session.add_all(Checkpoint(job_id=job.job_id, step=s, path="/x", bytes=1) for s in steps)
    session.flush()
    return job


class TestNames:
    def test_a_native_jobs_name_with_colons_round_trips(self, box: tuple[sessionmaker, Settings]) -> None:
        sessions, settings = box
        with sessions() as session:
            alice = _openai_caller(session, "alice")
            job = _job(session, alice, name="a:b", steps=(4,))
            name = fine_tuned_model(job, "alice", "a:b")
            assert name == f"ft:tiny:alice:a:b:{job.job_id}"
            assert get_model(session, alice, name, settings.model_root).owned_by == "alice"
            assert get_model(session, alice, checkpoint_model(name, 4), settings.model_root).id == f"{name}:ckpt-step-4"
            for wrong in (f"ft:tiny:bob:a:b:{job.job_id}", f"ft:other:alice:a:b:{job.job_id}", checkpoint_model(name, 5)):
                with pytest.raises(NotFound) as refused:
                    get_model(session, alice, wrong, settings.model_root)
                assert refused.value.param == "model"

    def test_an_unowned_job_is_named_for_the_organization(self) -> None:
        job = Job(job_id="job-1", model="org/base")
        assert fine_tuned_model(job, None, None) == f"ft:org/base:{ORGANIZATION}::job-1"


class TestList:
    def test_bases_by_name_then_jobs_newest_first_each_with_its_checkpoints(
        self, box: tuple[sessionmaker, Settings]
    ) -> None:
        sessions, settings = box
        (settings.model_root / "org" / "base").mkdir(parents=True)
        (settings.model_root / "org" / "base" / "config.json").write_text("{}")
        with sessions() as session:
            alice = _openai_caller(session, "alice")
            older = _job(session, alice, name="old", steps=(1, 2))
            running = _job(session, alice, name="run", status="running", steps=(3,))
            running.created_at = older.created_at.replace(year=older.created_at.year + 1)
            queued = _job(session, alice, name="q", status="queued")
            queued.created_at = older.created_at.replace(year=older.created_at.year - 1)
            session.flush()
            listed = [m.id for m in list_models(session, alice, settings.model_root)]
            old = f"ft:tiny:alice:old:{older.job_id}"
            assert listed == ["org/base", "tiny", f"ft:tiny:alice:run:{running.job_id}:ckpt-step-3",
                              old, f"{old}:ckpt-step-2", f"{old}:ckpt-step-1"]
            bob = _openai_caller(session, "bob")
            assert [m.id for m in list_models(session, bob, Path(settings.model_root))] == ["org/base", "tiny"]
