"""``/openai/v1/models`` through the official ``openai`` client (over the app in-process, both
stores): the bases under the model root, then the caller's tuned models by the names the job and
checkpoint objects show, each retrievable; someone else's, an unfinished job's and unknown names
are 404s in OpenAI's error shape. Another project's names: tests/integration/test_projects_routes.py."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from core.jobs.models import Checkpoint
from tests.integration.helpers import finish, make_user

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on a mat"}]}
ERROR_KEYS = {"message", "type", "param", "code"}


def sdk(client: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/openai/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture
def oai(client: TestClient, admin_key: str) -> Iterator[openai.OpenAI]:
    with sdk(client, admin_key) as admin:
        yield admin


@pytest.fixture
def alice(client: TestClient, store) -> Iterator[openai.OpenAI]:
    with sdk(client, make_user(store, "alice")) as alice:
        yield alice


def tuned_job(user: openai.OpenAI, store, tmp_path: Path, *, suffix: str, steps: tuple[int, ...] = (1, 2)) -> str:
    """A succeeded job of ``user`` with a checkpoint at each of ``steps``."""
    upload = "".join(json.dumps(CHAT) + "\n" for _ in range(40)).encode()
    train = user.files.create(file=("train.jsonl", upload), purpose="fine-tune").id
    job = user.fine_tuning.jobs.create(model="tiny", training_file=train, suffix=suffix)
    with store.sessions() as session:
        for step in steps:
            (tmp_path / f"{job.id}-{step}").mkdir()
            session.add(Checkpoint(job_id=job.id, step=step, path=str(tmp_path / f"{job.id}-{step}"), bytes=1,
                                   final=step == steps[-1]))
        session.commit()
    finish(store, job.id)
    return job.id


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


class TestList:
    def test_bases_then_each_tuned_model_and_its_checkpoints_by_their_job_names(
        self, oai: openai.OpenAI, store, tmp_path: Path
    ) -> None:
        job_id = tuned_job(oai, store, tmp_path, suffix="demo")
        job = oai.fine_tuning.jobs.retrieve(job_id)
        checkpoints = [c.fine_tuned_model_checkpoint for c in oai.fine_tuning.jobs.checkpoints.list(job_id)]
        assert job.fine_tuned_model == f"ft:tiny:admin:demo:{job_id}"
        assert checkpoints == [f"{job.fine_tuned_model}:ckpt-step-2", f"{job.fine_tuned_model}:ckpt-step-1"]
        models = oai.models.list().data
        assert [m.id for m in models] == ["tiny", job.fine_tuned_model, *checkpoints]
        assert {(m.object, m.owned_by) for m in models} == {("model", "ftq"), ("model", "admin")}
        assert models[1].created == job.finished_at
        for model in models:
            assert oai.models.retrieve(model.id) == model

    def test_a_base_in_a_folder_is_retrieved_by_its_path(self, oai: openai.OpenAI, model_root: Path) -> None:
        (model_root / "org" / "name").mkdir(parents=True)
        shutil.copy(model_root / "tiny" / "config.json", model_root / "org" / "name" / "config.json")
        assert [m.id for m in oai.models.list()] == ["org/name", "tiny"]
        assert oai.models.retrieve("org/name").id == "org/name"  # the client sends org%2Fname

    def test_a_job_that_has_not_succeeded_shows_only_its_checkpoints(self, oai: openai.OpenAI, store,
                                                                     tmp_path: Path) -> None:
        upload = "".join(json.dumps(CHAT) + "\n" for _ in range(40)).encode()
        train = oai.files.create(file=("train.jsonl", upload), purpose="fine-tune").id
        running = oai.fine_tuning.jobs.create(model="tiny", training_file=train, suffix="half").id
        with store.sessions() as session:
            session.add(Checkpoint(job_id=running, step=3, path=str(tmp_path), bytes=1))
            session.commit()
        name = f"ft:tiny:admin:half:{running}"
        assert [m.id for m in oai.models.list()] == ["tiny", f"{name}:ckpt-step-3"]
        assert oai.models.retrieve(f"{name}:ckpt-step-3").id == f"{name}:ckpt-step-3"
        with pytest.raises(openai.NotFoundError):
            oai.models.retrieve(name)

    def test_a_native_job_is_named_by_its_name(self, oai: openai.OpenAI, client: TestClient, store) -> None:
        upload = "".join(json.dumps(CHAT) + "\n" for _ in range(20))
        train = client.post("/v1/files", files={"file": ("t.jsonl", upload)}, data={"purpose": "train"}).json()["id"]
        created = client.post("/v1/jobs", json={"model": "tiny", "training_file": train, "name": "nat"})
        assert created.status_code == 201, created.text
        native = created.json()["id"]
        finish(store, native)
        assert oai.fine_tuning.jobs.retrieve(native).fine_tuned_model == f"ft:tiny:admin:nat:{native}"
        assert oai.models.retrieve(f"ft:tiny:admin:nat:{native}").owned_by == "admin"


class TestNotFound:
    def test_another_users_models_are_as_unknown_ones(self, alice: openai.OpenAI, client: TestClient, store,
                                                      tmp_path: Path) -> None:
        job_id = tuned_job(alice, store, tmp_path, suffix="mine")
        theirs = [m.id for m in alice.models.list()]
        assert theirs == ["tiny", f"ft:tiny:alice:mine:{job_id}", *(f"ft:tiny:alice:mine:{job_id}:ckpt-step-{s}"
                                                                   for s in (2, 1))]
        with sdk(client, make_user(store, "bob")) as bob:
            assert [m.id for m in bob.models.list()] == ["tiny"]
            for name in theirs[1:]:
                with pytest.raises(openai.NotFoundError) as info:
                    bob.models.retrieve(name)
                error = error_of(info.value)
                assert error == {"message": f"The model '{name}' does not exist or you do not have access to it.",
                                 "type": "invalid_request_error", "param": "model", "code": "model_not_found"}

    @pytest.mark.parametrize("name", [
        "gpt-4o-mini", "tiny/", "ft:tiny:admin:demo:job-000000000000000000000000", "ft:", "ft:tiny",
        "{wrong_suffix}", "{name}:ckpt-step-7", "{name}:ckpt-step-x", "{name}:ckpt-step-2:ckpt-step-2",
    ])
    def test_unknown_names_answer_404_naming_model(self, oai: openai.OpenAI, store, tmp_path: Path, name: str) -> None:
        job_id = tuned_job(oai, store, tmp_path, suffix="demo")
        name = name.format(name=f"ft:tiny:admin:demo:{job_id}", wrong_suffix=f"ft:tiny:admin:other:{job_id}")
        with pytest.raises(openai.NotFoundError) as info:
            oai.models.retrieve(name)
        assert error_of(info.value)["param"] == "model"
