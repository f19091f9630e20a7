"""Generation jobs in core: the spec's refusals name the field, the submission path (a real SQLite
store, the API's generation preflight) refuses a bad file or model before anything is stored, the
model references resolve to the weights the worker loads, and the worker's job.json follows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from core.db import new_id, utcnow
from core.errors import InvalidInput
from core.files.models import File
from core.jobs import artifact_store, generation, rerun, service
from core.jobs.generate_spec import GenerateSpec
from core.jobs.models import Checkpoint, Job
from core.jobs.submit import Origin, submit
from core.projects import service as projects
from core.settings import Settings
from core.users import service as users
from core.users.service import Caller
from trainer.generate.job_config import SAMPLING_FIELDS, GenerateConfig


def _spec(**fields: Any) -> GenerateSpec:
    return GenerateSpec.model_validate({"kind": "generate", "model": "tiny", "prompts_file": "file-" + "0" * 24,
                                        **fields})


class TestGenerateSpec:
    @pytest.mark.parametrize(("fields", "loc", "says"), [
        ({"sampling": {"top_p": 0}}, ("sampling", "top_p"), "greater than 0"),
        ({"sampling": {"temperature": 3.0}}, ("sampling", "temperature"), "less than or equal to 2"),
        ({"sampling": {"top_logprobs": 2}}, ("sampling", "top_logprobs"), "needs logprobs"),
        ({"sampling": {"max_tokens": 0}}, ("sampling", "max_tokens"), "greater than or equal to 1"),
        ({"sampling": {"stop": [""]}}, ("sampling", "stop", 0), "at least 1 character"),
        ({"sampling": {"beam_width": 4}}, ("sampling", "beam_width"), "Extra inputs"),
        ({"model": "job:42"}, ("model",), "job:<job id>"),
        ({"prompts_file": "prompts.jsonl"}, ("prompts_file",), "purpose=generate"),
        ({"gpus": 0}, ("gpus",), "greater than or equal to 1"),
    ])
    def test_a_bad_field_is_refused_naming_it(self, fields, loc, says) -> None:
        with pytest.raises(ValidationError) as refused:
            _spec(**fields)
        (error,) = refused.value.errors()
        assert error["loc"] == loc and says in error["msg"]

    def test_sampling_follows_the_trainer_s_fields(self) -> None:
        assert tuple(_spec().sampling.model_dump()) == SAMPLING_FIELDS

    def test_a_clone_of_a_stored_generation_spec_is_a_generation_spec(self) -> None:
        clone = rerun.cloned_spec(_spec(sampling={"seed": 4}).to_stored(), {"sampling": {"n": 2}, "name": "again"})
        assert isinstance(clone, GenerateSpec) and (clone.sampling.n, clone.sampling.seed, clone.name) == (2, 4, "again")


class Ports:
    """The API's ports for a generation spec: its preflight is ``core.jobs.generation.preflight``."""

    def __init__(self, sessions: sessionmaker, settings: Settings) -> None:
        self.settings, self._sessions = settings, sessions
        self.woken: list[str] = []

    def sessions(self) -> Session:
        return self._sessions()

    async def preflight(self, spec: GenerateSpec, owner: Caller) -> dict[str, Any]:
        with self._sessions() as session:
            return generation.preflight(session, spec, settings=self.settings, project_id=owner.project_id)

    def wake(self, job_id: str) -> None:
        self.woken.append(job_id)

    async def notify(self, job_id: str, seq: int) -> None:
        return None


def _user_with_file(sessions: sessionmaker, name: str, purpose: str = "generate",
                    project: str | None = None) -> tuple[Caller, str]:
    with sessions() as session:
        if project is not None:
            projects.create_project(session, project)
        user = users.create_user(session, name, project_names=[project] if project else None)
        caller = users.caller_of(session, user)
        file_id = new_id("file")
        path = Path(str(sessions.kw["bind"].url.database)).parent / f"{file_id}.jsonl"
        path.write_text('{"prompt": "Hi"}\n')
        session.add(File(file_id=file_id, filename="p.jsonl", purpose=purpose, bytes=1, sha256="0" * 64,
                         format="prompts", num_records=1, path=str(path), stats={"text_prompts": 1},
                         owner_id=user.user_id, project_id=caller.project_id, created_at=utcnow()))
        session.commit()
    return caller, file_id


def _training_job(sessions: sessionmaker, settings: Settings, owner: Caller, file_id: str, *, status: str,
                  steps: tuple[int, ...] = ()) -> str:
    with sessions() as session:
        job_id = new_id("job")
        session.add(Job(job_id=job_id, status=status, model="tiny", method="lora", spec={}, training_file_id=file_id,
                        owner_id=owner.user_id, project_id=owner.project_id, output_dir="/x"))
        session.flush()
        for step in steps:
            path = artifact_store.checkpoint_store_dir(settings, job_id, step)
            path.mkdir(parents=True)
            (path / "adapter_config.json").write_text("{}")
            session.add(Checkpoint(job_id=job_id, step=step, path=str(path), bytes=1))
        session.commit()
    artifact_store.final_store_dir(settings, job_id, "lora").mkdir(parents=True)
    return job_id


def _submit(ports: Ports, spec: GenerateSpec, owner: Caller) -> str:
    job_id, _ = anyio.run(lambda: submit(ports, spec, owner, Origin(), view=lambda _s, job: job.job_id))
    return job_id


def _stored(sessions: sessionmaker) -> int:
    with sessions() as session:
        return len(service.list_jobs(session)[0])


class TestSubmitGeneration:
    def test_a_job_of_kind_generate_is_queued_with_its_prompts_file(self, box) -> None:
        sessions, settings = box
        alice, file_id = _user_with_file(sessions, "alice")
        ports = Ports(sessions, settings)
        job_id = _submit(ports, _spec(prompts_file=file_id, sampling={"seed": 3, "n": 2}), alice)
        assert ports.woken == [job_id]
        with sessions() as session:
            job = session.get(Job, job_id)
            assert (job.kind, job.method, job.training_file_id, job.status) == ("generate", "generate", file_id,
                                                                               "queued")
            assert job.preflight["records"] == 1 and job.spec["sampling"]["n"] == 2
            config = generation.build_generate_config(session, job, settings=settings, output_dir="/out")
        assert isinstance(config, GenerateConfig) and config.adapter is None
        assert config.model == str(settings.model_root / "tiny") and config.sampling["seed"] == 3
        # A remote worker passes its downloads: the prompts file comes from ``files_for``.
        fetched = settings.data_dir / "cache" / "files" / "prompts"
        fetched.parent.mkdir(parents=True)
        fetched.write_text('{"prompt": "hi"}\n')
        with sessions() as session:
            remote = generation.build_generate_config(
                session, session.get(Job, job_id), settings=settings, output_dir="/out",
                files_for=lambda _s, ids: {ids[0]: str(fetched)})
        assert remote.prompts_file == str(fetched) and remote.model == config.model

    @pytest.mark.parametrize(("purpose", "fields", "param", "says"), [
        ("train", {}, "prompts_file", "purpose=train"),
        ("generate", {"model": "nowhere"}, "model", "nowhere"),
        ("generate", {"model": "job:job-" + "a" * 24}, "model", "no training job"),
        ("generate", {"model": "export:exp-" + "a" * 24}, "model", "no export"),
    ])
    def test_a_bad_file_or_model_is_refused_naming_it_and_nothing_is_stored(self, box, purpose, fields, param,
                                                                             says) -> None:
        sessions, settings = box
        alice, file_id = _user_with_file(sessions, "alice", purpose)
        with pytest.raises(InvalidInput, match=says) as refused:
            _submit(Ports(sessions, settings), _spec(prompts_file=file_id, **fields), alice)
        assert refused.value.param == param and _stored(sessions) == 0

    def test_a_job_reference_resolves_to_its_adapter_on_its_base(self, box) -> None:
        sessions, settings = box
        alice, file_id = _user_with_file(sessions, "alice")
        done = _training_job(sessions, settings, alice, file_id, status="succeeded", steps=(4,))
        running = _training_job(sessions, settings, alice, file_id, status="running")
        with sessions() as session:
            final = generation.resolve(session, f"job:{done}", settings=settings, project_id=alice.project_id)
            step = generation.resolve(session, f"job:{done}@4", settings=settings, project_id=alice.project_id)
            for ref, says in ((f"job:{done}@8", "no checkpoint at step 8"), (f"job:{running}", "is running")):
                with pytest.raises(InvalidInput, match=says):
                    generation.resolve(session, ref, settings=settings, project_id=alice.project_id)
        base = str(settings.model_root / "tiny")
        assert final == generation.ResolvedModel(base, str(artifact_store.final_store_dir(settings, done, "lora")))
        assert step == generation.ResolvedModel(base, str(artifact_store.checkpoint_store_dir(settings, done, 4)))

    def test_a_job_of_another_project_is_refused_as_unknown(self, box) -> None:
        sessions, settings = box
        alice, file_id = _user_with_file(sessions, "alice")
        bob, bobs_file = _user_with_file(sessions, "bob", project="elsewhere")
        theirs = _training_job(sessions, settings, alice, file_id, status="succeeded")
        assert alice.project_id != bob.project_id
        with pytest.raises(InvalidInput, match="no training job") as refused:
            _submit(Ports(sessions, settings), _spec(prompts_file=bobs_file, model=f"job:{theirs}"), bob)
        assert refused.value.param == "model" and _stored(sessions) == 1  # alice's training job alone
