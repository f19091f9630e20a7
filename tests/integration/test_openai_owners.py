"""``/openai/v1`` reads per owner, as OpenAI's API does (issue 23): another user's file, file
content, job, events, checkpoints and results file answer 404 in OpenAI's error shape, exactly as
an unknown id does, with nothing of the owner's in the body; the owner reads them; an admin reads
everyone's. The route test enumerates the OpenAI app's routes from its OpenAPI schema, so a route
added later is checked without anyone listing it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from core.jobs.models import Checkpoint, StepMetric
from tests.integration.helpers import bearer, finish, make_user

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "alice's secret question"},
                     {"role": "assistant", "content": "alice's secret answer"}]}
ERROR_KEYS = {"message", "type", "param", "code"}


def jsonl(n: int) -> bytes:
    return "".join(json.dumps(CHAT) + "\n" for _ in range(n)).encode()


def sdk(client: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/openai/v1", api_key=key, http_client=client, max_retries=0)


@dataclass(frozen=True)
class AliceWork:
    training_file: str
    validation_file: str
    validation_twin: str
    job: str
    results_file: str


@pytest.fixture
def alice_key(store) -> str:
    return make_user(store, "alice")


@pytest.fixture
def bob_key(store) -> str:
    return make_user(store, "bob")


@pytest.fixture
def alice(client: TestClient, alice_key: str) -> Iterator[openai.OpenAI]:
    with sdk(client, alice_key) as alice:
        yield alice


@pytest.fixture
def bob(client: TestClient, bob_key: str) -> Iterator[openai.OpenAI]:
    with sdk(client, bob_key) as bob:
        yield bob


@pytest.fixture
def work(alice: openai.OpenAI, client: TestClient, store, tmp_path: Path) -> AliceWork:
    """Alice's training and validation files and a finished job with metrics, a checkpoint and
    a results file."""
    train = alice.files.create(file=("alice-train.jsonl", jsonl(40)), purpose="fine-tune").id
    valid = alice.files.create(file=("alice-valid.jsonl", jsonl(5)), purpose="fine-tune").id
    job = alice.fine_tuning.jobs.create(model="tiny", training_file=train, validation_file=valid, suffix="alice")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with store.sessions() as session:
        session.add_all(StepMetric(job_id=job.id, step=s, loss=2.0 / s, lr=1e-4, tokens=100) for s in (1, 2))
        session.add(Checkpoint(job_id=job.id, step=2, path=str(ckpt), bytes=1, final=True))
        session.commit()
    finish(store, job.id)
    results = alice.fine_tuning.jobs.retrieve(job.id).result_files
    assert len(results) == 1
    twin = client.get(f"/v1/jobs/{job.id}").json()["validation_file"]  # the admin's native view
    return AliceWork(train, valid, twin, job.id, results[0])


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def assert_not_found(call, *args, **kwargs) -> dict:
    with pytest.raises(openai.NotFoundError) as info:
        call(*args, **kwargs)
    error = error_of(info.value)
    assert "alice" not in info.value.response.text, info.value.response.text
    return error


class TestAnotherUsersIds:
    def test_bob_gets_404_for_each_of_alices_reads(self, bob: openai.OpenAI, work: AliceWork) -> None:
        for file_id in (work.training_file, work.validation_file, work.validation_twin):
            assert assert_not_found(bob.files.content, file_id)["message"] == f"No such File object: {file_id}"
            assert_not_found(bob.files.retrieve, file_id)
        assert assert_not_found(bob.fine_tuning.jobs.retrieve, work.job)["param"] == "job_id"
        assert_not_found(bob.fine_tuning.jobs.list_events, work.job)
        assert_not_found(bob.fine_tuning.jobs.checkpoints.list, work.job)
        assert_not_found(bob.files.retrieve, work.results_file)
        assert_not_found(bob.files.content, work.results_file)

    def test_bob_cannot_delete_cancel_or_train_on_alices_work(self, alice: openai.OpenAI, bob: openai.OpenAI,
                                                               work: AliceWork) -> None:
        assert_not_found(bob.files.delete, work.training_file)
        assert_not_found(bob.fine_tuning.jobs.cancel, work.job)
        with pytest.raises(openai.BadRequestError) as info:  # as an unknown file is: "no file"
            bob.fine_tuning.jobs.create(model="tiny", training_file=work.training_file)
        error = error_of(info.value)
        assert error["param"] == "training_file" and "no file" in error["message"]
        assert "alice" not in info.value.response.text
        assert alice.files.retrieve(work.training_file).id == work.training_file

    def test_lists_show_bob_only_his_own_and_alices_ids_do_not_page(self, bob: openai.OpenAI,
                                                                    work: AliceWork) -> None:
        own = bob.files.create(file=("bob.jsonl", jsonl(40)), purpose="fine-tune").id
        assert [f.id for f in bob.files.list()] == [own]
        assert bob.fine_tuning.jobs.list().data == []
        with pytest.raises(openai.BadRequestError) as info:  # as an unknown id is
            bob.files.list(after=work.training_file)
        assert error_of(info.value)["param"] == "after"
        with pytest.raises(openai.BadRequestError):
            bob.fine_tuning.jobs.list(after=work.job)

    def test_alice_reads_her_own(self, alice: openai.OpenAI, work: AliceWork) -> None:
        assert alice.files.content(work.training_file).content == jsonl(40)
        assert alice.files.content(work.validation_file).content == jsonl(5)
        assert alice.files.retrieve(work.validation_file).filename == "alice-valid.jsonl"
        assert alice.fine_tuning.jobs.retrieve(work.job).status == "succeeded"
        assert alice.fine_tuning.jobs.list_events(work.job).data
        assert [c.step_number for c in alice.fine_tuning.jobs.checkpoints.list(work.job)] == [2]
        assert alice.files.retrieve(work.results_file).purpose == "fine-tune-results"
        assert alice.files.content(work.results_file).text.splitlines()[0].startswith("step,train_loss")
        assert [j.id for j in alice.fine_tuning.jobs.list()] == [work.job]
        assert {f.id for f in alice.files.list()} == {work.training_file, work.validation_file}

    def test_an_admin_reads_everyones(self, client: TestClient, admin_key: str, bob: openai.OpenAI,
                                      work: AliceWork) -> None:
        bobs = bob.files.create(file=("bob.jsonl", jsonl(40)), purpose="fine-tune").id
        with sdk(client, admin_key) as admin:
            assert admin.files.content(work.training_file).content == jsonl(40)
            assert admin.files.content(bobs).content == jsonl(40)
            assert admin.fine_tuning.jobs.retrieve(work.job).id == work.job
            assert admin.fine_tuning.jobs.list_events(work.job).data
            assert admin.fine_tuning.jobs.checkpoints.list(work.job).data
            assert admin.files.content(work.results_file).text.startswith("step,")
            assert {f.id for f in admin.files.list()} >= {work.training_file, work.validation_file, bobs}
            assert [j.id for j in admin.fine_tuning.jobs.list()] == [work.job]


class TestEveryRoute:
    def test_every_route_with_an_id_answers_404_for_another_users_ids(
        self, client: TestClient, bob_key: str, work: AliceWork
    ) -> None:
        schema = client.get("/openai/v1/openapi.json").json()
        ids = {"file_id": [work.training_file, work.validation_file, work.validation_twin, work.results_file],
               "job_id": [work.job]}
        checked = set()
        for template, operations in schema["paths"].items():
            params = [name for name in ids if "{%s}" % name in template]
            if not params:
                continue
            assert len(params) == 1, template
            for method in operations:
                for value in ids[params[0]]:
                    path = "/openai/v1" + template.replace("{%s}" % params[0], value)
                    response = client.request(method.upper(), path, headers=bearer(bob_key))
                    assert response.status_code == 404, (method, path, response.text)
                    assert set(response.json()["error"]) == ERROR_KEYS
                    assert "alice" not in response.text and "secret" not in response.text, response.text
                    checked.add((method, template))
        assert {("get", "/files/{file_id}/content"), ("delete", "/files/{file_id}"),
                ("get", "/fine_tuning/jobs/{job_id}/checkpoints"), ("post", "/fine_tuning/jobs/{job_id}/pause")} <= checked
        # Nothing of Alice's changed.
        alice = client.get(f"/v1/jobs/{work.job}").json()
        assert alice["status"] == "succeeded"
        assert client.get(f"/v1/files/{work.training_file}").status_code == 200
