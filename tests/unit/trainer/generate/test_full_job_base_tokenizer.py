"""A full fine-tune saved before its ``model/`` carried tokenizer files (ftq did so until full jobs
saved the tokenizer they trained with) is generated from and chatted with on its base's tokenizer
and chat template: ``core.jobs.generation.resolve`` names the base as ``tokenizer``, and the trainer
loads it from there.

The old job is simulated as it would be found in a store: a succeeded ``method: full`` job on
``tiny`` (a real SQLite store, a real tiny Llama in the model root) whose ``model/`` holds the
model's config and weights and nothing else. Its completions, run by the trainer from the job.json
the worker would write, are the same bytes as those of the same job with the tokenizer present; a
session's replies are the same tokens; with the base gone from the model root the submission is
refused naming ``model`` and the base.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from core import migrate
from core.db import make_engine, make_sessionmaker, new_id, utcnow
from core.errors import InvalidInput
from core.files.models import File
from core.jobs import artifact_store, generation
from core.jobs.generate_spec import GenerateSpec
from core.jobs.models import Job
from core.sessions.service import build_session_config
from core.sessions.spec import SessionSpec
from core.settings import Settings
from core.users import service as users
from trainer.generate.job import run_generation
from trainer.generate.session import STOPPED, run_session
from trainer.generate.session_config import BASE
from trainer.parallel.distributed import World

pytestmark = pytest.mark.usefixtures("one_thread")
ONE = World(rank=0, world_size=1, local_rank=0)
PROMPTS = [{"prompt": "Count to three:"}, {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}]
SAMPLING = {"max_tokens": 6, "temperature": 0}
SAVED_BY_OLD_FULL_JOBS = {"config.json", "generation_config.json", "model.safetensors"}
"""What ``model.save_pretrained`` alone wrote: a full job's ``model/`` before it kept the tokenizer."""


class Box:
    """A migrated SQLite store, the box's settings (the model root holds the tiny Llama as ``tiny``),
    a prompts file and a succeeded full job on ``tiny`` whose ``model/`` has the tokenizer."""

    def __init__(self, tmp_path: Path, model_root: Path) -> None:
        url = f"sqlite:///{tmp_path / 'ftq.db'}"
        migrate.upgrade(url)
        self.engine = make_engine(url)
        self.sessions: sessionmaker = make_sessionmaker(self.engine)
        self.settings = Settings(data_dir=tmp_path / "data", model_root=model_root, allow_hub_models=False).resolved()
        self.base = model_root / "tiny"
        with self.sessions() as session:
            user = users.create_user(session, "alice")
            self.project_id = users.caller_of(session, user).project_id
            self.prompts_file = new_id("file")
            path = tmp_path / "prompts.jsonl"
            path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
            session.add(File(file_id=self.prompts_file, filename="p.jsonl", purpose="generate", bytes=1,
                             sha256="0" * 64, format="prompts", num_records=len(PROMPTS), path=str(path),
                             stats={"text_prompts": 1, "chat_prompts": 1}, owner_id=user.user_id,
                             project_id=self.project_id, created_at=utcnow()))
            self.full = new_id("job")
            session.add(Job(job_id=self.full, status="succeeded", model="tiny", method="full", spec={},
                            training_file_id=self.prompts_file, owner_id=user.user_id, project_id=self.project_id,
                            output_dir=str(self.settings.jobs_dir / self.full)))
            session.commit()
        self.weights = artifact_store.final_store_dir(self.settings, self.full, "full")
        shutil.copytree(self.base, self.weights)  # a full job's model/ as saved now: weights and tokenizer

    def strip_tokenizer(self) -> None:
        """Make the full job's ``model/`` what a full job saved before it kept the tokenizer."""
        for path in self.weights.iterdir():
            if path.name not in SAVED_BY_OLD_FULL_JOBS:
                path.unlink()
        assert {p.name for p in self.weights.iterdir()} == SAVED_BY_OLD_FULL_JOBS

    def generation_job(self, name: str) -> Job:
        spec = GenerateSpec.model_validate({"kind": "generate", "model": f"job:{self.full}",
                                            "prompts_file": self.prompts_file, "sampling": SAMPLING})
        with self.sessions() as session:
            generation.preflight(session, spec, settings=self.settings, project_id=self.project_id)
            job = Job(job_id=new_id("job"), kind="generate", status="queued", model=spec.model, method="generate",
                      spec=spec.to_stored(), training_file_id=self.prompts_file, owner_id=None,
                      project_id=self.project_id, output_dir=str(self.settings.jobs_dir / name))
            session.add(job)
            session.commit()
            session.refresh(job)
            session.expunge(job)
        return job

    def completions(self, name: str) -> tuple[bytes, Any]:
        """A generation job on ``job:<full>`` run by the trainer from the job.json the worker writes."""
        job = self.generation_job(name)
        with self.sessions() as session:
            config = generation.build_generate_config(session, job, settings=self.settings,
                                                      output_dir=job.output_dir)
        assert run_generation(config, lambda *_a, **_k: None, ONE) == "succeeded"
        return config.completions_path.read_bytes(), config

    def session_config(self, session: Session) -> Any:
        spec = SessionSpec(models=[f"job:{self.full}"])
        job = Job(job_id=new_id("job"), kind="session", status="queued", model=spec.models[0], method="session",
                  spec=spec.to_stored(), training_file_id=None, owner_id=None, project_id=self.project_id,
                  output_dir="/unused", preflight={"adapters": {spec.models[0]: BASE}})
        session.add(job)
        session.flush()
        return build_session_config(session, job, settings=self.settings, output_dir="/unused")


@pytest.fixture
def box(tmp_path: Path, model_root: Path) -> Iterator[Box]:
    made = Box(tmp_path, model_root)
    yield made
    made.engine.dispose()


def test_an_old_full_jobs_completions_equal_those_with_its_tokenizer(box: Box) -> None:
    with_tokenizer, first = box.completions("with")
    box.strip_tokenizer()
    without, config = box.completions("without")
    assert without == with_tokenizer
    assert first.model == config.model == str(box.weights) and first.tokenizer is None
    assert config.tokenizer == str(box.base), config
    lines = [json.loads(line) for line in without.splitlines()]
    assert [line["index"] for line in lines] == [0, 1] and all(line["choices"][0]["tokens"] for line in lines)


def test_the_submission_report_says_the_tokenizer_is_the_bases(box: Box) -> None:
    box.strip_tokenizer()
    spec = GenerateSpec.model_validate({"kind": "generate", "model": f"job:{box.full}",
                                        "prompts_file": box.prompts_file})
    with box.sessions() as session:
        report = generation.preflight(session, spec, settings=box.settings, project_id=box.project_id)
    assert f"the base's tokenizer and chat template are used ({box.base})" in report["note"], report


def test_without_its_base_an_old_full_job_is_refused_naming_model_and_the_base(box: Box) -> None:
    box.strip_tokenizer()
    shutil.rmtree(box.base)
    with pytest.raises(InvalidInput) as refused:
        box.generation_job("refused")
    assert refused.value.param == "model"
    message = str(refused.value)
    assert message.startswith(f"model: job {box.full}'s model/ has no tokenizer files"), message
    assert "its base 'tiny'" in message and "not available here" in message and str(box.base) in message


def test_a_session_on_an_old_full_job_replies_as_with_its_tokenizer(box: Box) -> None:
    request = {"op": "request", "id": "r", "adapter": BASE, "messages": PROMPTS[1]["messages"],
               "params": {"max_tokens": 6, "temperature": 0.0}}
    with box.sessions() as session:
        tokens = {"with": _session_tokens(box.session_config(session), request)}
        box.strip_tokenizer()
        config = box.session_config(session)
    tokens["without"] = _session_tokens(config, request)
    assert tokens["with"] and tokens["without"] == tokens["with"]
    assert config.model == str(box.weights) and config.tokenizer == str(box.base), config


def _session_tokens(config: Any, request: dict[str, Any]) -> list[int]:
    """The token ids a session on ``config`` (on the CPU) streams for ``request``: the request is
    the whole of its stdin, so the session drains it and stops."""
    from dataclasses import replace

    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as inbox:
        inbox.write(json.dumps(request) + "\n")
    events: list[tuple[str, dict[str, Any]]] = []
    with os.fdopen(read_fd) as inbox:
        status = run_session(replace(config, device="cpu", max_len=64), lambda t, **p: events.append((t, p)),
                             inbox, threading.Event(), poll_s=0.02)
    assert status == STOPPED
    replies = [p for t, p in events if t == "reply" and p.get("id") == "r"]
    assert not any(p["kind"] == "error" for p in replies), replies
    return [t for p in replies if p["kind"] == "delta" for t in p["token_ids"]]
