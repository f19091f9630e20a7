"""``/openai/v1`` driven by the official ``openai`` client (over the app in-process, both stores):
files, job creation with ``auto`` resolved, paging, pause/resume/cancel of queued jobs, and bad
files and bodies answered in OpenAI's error shape. Training itself: tests/integration/e2e/test_openai_e2e.py."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from core.files.models import File
from tests.integration.helpers import make_user

pytestmark = pytest.mark.integration

CHAT = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on a mat"}]}
PAIR = {"input": {"messages": [{"role": "user", "content": "the cat"}]},
        "preferred_output": [{"role": "assistant", "content": "sat on a mat"}],
        "non_preferred_output": [{"role": "assistant", "content": "ran away"}]}
ERROR_KEYS = {"message", "type", "param", "code"}


def jsonl(record: dict, n: int = 40) -> bytes:
    return "".join(json.dumps(record) + "\n" for _ in range(n)).encode()


@pytest.fixture
def chat_file(oai: openai.OpenAI) -> str:
    return oai.files.create(file=("train.jsonl", jsonl(CHAT)), purpose="fine-tune").id


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


class TestFiles:
    def test_upload_retrieve_list_content_delete(self, oai: openai.OpenAI, client: TestClient) -> None:
        content = jsonl(CHAT, 3)
        created = oai.files.create(file=("train.jsonl", content), purpose="fine-tune")
        assert (created.object, created.purpose, created.bytes, created.filename) == (
            "file", "fine-tune", len(content), "train.jsonl")
        assert oai.files.retrieve(created.id).id == created.id
        assert [f.id for f in oai.files.list()] == [created.id]
        assert oai.files.content(created.id).content == content
        # One store: the native API sees the same file.
        assert client.get(f"/v1/files/{created.id}").json()["num_records"] == 3
        assert oai.files.delete(created.id).deleted is True
        with pytest.raises(openai.NotFoundError) as info:
            oai.files.retrieve(created.id)
        assert error_of(info.value)["param"] == "file_id"

    def test_a_bad_line_is_a_400_naming_the_line(self, oai: openai.OpenAI) -> None:
        bad = jsonl(CHAT, 2) + b'{"messages": [{"role": "user", "content": "no answer"}]}\n'
        with pytest.raises(openai.BadRequestError) as info:
            oai.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
        error = error_of(info.value)
        assert error["message"].startswith("line 3: ") and error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == ("file", "invalid_dataset")

    def test_another_purpose_is_refused(self, oai: openai.OpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            oai.files.create(file=("b.jsonl", jsonl(CHAT, 1)), purpose="batch")
        assert error_of(info.value)["param"] == "purpose"


class TestCreate:
    def test_auto_is_resolved_and_the_job_is_an_ftq_job(self, oai: openai.OpenAI, client: TestClient, store,
                                                        chat_file: str) -> None:
        valid = oai.files.create(file=("valid.jsonl", jsonl(CHAT, 5)), purpose="fine-tune").id
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file, validation_file=valid,
                                          suffix="demo", seed=7, metadata={"team": "search"},
                                          hyperparameters={"n_epochs": 2})
        assert (job.object, job.status, job.seed, job.metadata) == ("fine_tuning.job", "queued", 7, {"team": "search"})
        # 40 records: batch_size 40/32 -> 1, its multiplier sqrt(1/8) -> 0.5; n_epochs as asked.
        assert job.hyperparameters.model_dump(exclude_none=True) == {
            "batch_size": 1, "learning_rate_multiplier": 0.5, "n_epochs": 2}
        assert job.method.type == "supervised"
        assert job.method.supervised.hyperparameters.batch_size == 1
        assert (job.training_file, job.validation_file) == (chat_file, valid)
        native = client.get(f"/v1/jobs/{job.id}").json()
        assert native["name"] == "demo" and native["training_file"] == chat_file
        hp = native["spec"]["hyperparameters"]
        assert (hp["epochs"], hp["learning_rate"], hp["seed"]) == (2.0, pytest.approx(1e-4), 7)
        # The job validates on a validation twin of the fine-tune upload (same bytes), not listed here.
        with store.sessions() as session:
            twin = session.get(File, native["validation_file"])
            assert twin.purpose == "validation" and twin.sha256 == session.get(File, valid).sha256
        assert {f.id for f in oai.files.list()} == {chat_file, valid}

    def test_dpo_resolves_beta_and_trains_objective_dpo(self, oai: openai.OpenAI, client: TestClient) -> None:
        pairs = oai.files.create(file=("pairs.jsonl", jsonl(PAIR, 64)), purpose="fine-tune").id
        job = oai.fine_tuning.jobs.create(
            model="tiny", training_file=pairs,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": "auto", "n_epochs": 1}}})
        assert job.method.type == "dpo"
        assert job.method.dpo.hyperparameters.beta == 0.1 and job.hyperparameters.batch_size == 2
        spec = client.get(f"/v1/jobs/{job.id}").json()["spec"]
        assert (spec["objective"], spec["dpo"]["beta"]) == ("dpo", 0.1)

    def test_a_wandb_integration_is_the_jobs_wandb_tracking(self, oai: openai.OpenAI, client: TestClient,
                                                            chat_file: str) -> None:
        wandb = {"project": "sweeps", "name": "lr a", "entity": "my-team", "tags": ["lora"]}
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file,
                                          integrations=[{"type": "wandb", "wandb": wandb}])
        assert [i.model_dump() for i in job.integrations] == [{"type": "wandb", "wandb": wandb}]
        tracking = client.get(f"/v1/jobs/{job.id}").json()["spec"]["tracking"]
        assert {k: v for k, v in tracking.items() if k.startswith("wandb")} == {
            "wandb": True, "wandb_project": "sweeps", "wandb_name": "lr a", "wandb_entity": "my-team",
            "wandb_tags": ["lora"], "wandb_server": None}  # OpenAI's integration names no server: the default
        assert oai.fine_tuning.jobs.retrieve(job.id).integrations[0].wandb.project == "sweeps"
        assert oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file).integrations == []

    def test_list_pages_with_after_and_has_more(self, oai: openai.OpenAI, client: TestClient, chat_file: str) -> None:
        native = client.post("/v1/jobs", json={"model": "tiny", "training_file": chat_file}).json()
        made = [oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file).id for _ in range(2)]
        first = oai.fine_tuning.jobs.list(limit=2)
        assert [j.id for j in first.data] == made[::-1] and first.has_more is True
        rest = oai.fine_tuning.jobs.list(limit=2, after=first.data[-1].id)
        assert [j.id for j in rest.data] == [native["id"]] and rest.has_more is False
        # A native job in OpenAI's shape.
        assert rest.data[0].method.type == "supervised" and rest.data[0].hyperparameters.n_epochs == 1
        assert [j.id for j in oai.fine_tuning.jobs.list()] == [*made[::-1], native["id"]]

    def test_list_filters_by_metadata(self, oai: openai.OpenAI, client: TestClient, chat_file: str) -> None:
        search = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file, metadata={"team": "search"}).id
        ads = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file,
                                          metadata={"team": "ads", "run": "7"}).id
        native = client.post("/v1/jobs", json={"model": "tiny", "training_file": chat_file}).json()["id"]
        assert [j.id for j in oai.fine_tuning.jobs.list(metadata={"team": "search"})] == [search]
        assert [j.id for j in oai.fine_tuning.jobs.list(metadata={"team": "ads", "run": "7"})] == [ads]
        assert [j.id for j in oai.fine_tuning.jobs.list(metadata={"team": "ads", "run": "8"})] == []
        assert [j.id for j in oai.fine_tuning.jobs.list(extra_query={"metadata": "null"})] == [native]


class TestStopAndResume:
    def test_pause_resume_then_cancel_a_queued_job(self, oai: openai.OpenAI, client: TestClient, chat_file: str) -> None:
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file)
        assert oai.fine_tuning.jobs.pause(job.id).status == "paused"
        assert client.get(f"/v1/jobs/{job.id}").json()["status"] == "cancelled"
        with pytest.raises(openai.ConflictError):
            oai.fine_tuning.jobs.pause(job.id)
        assert oai.fine_tuning.jobs.resume(job.id).status == "queued"
        messages = [e.message for e in oai.fine_tuning.jobs.list_events(job.id)]
        assert messages[0] == "Fine-tuning job resumed and queued" and "paused" in messages[1]
        assert oai.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        with pytest.raises(openai.ConflictError) as info:
            oai.fine_tuning.jobs.resume(job.id)
        assert "not paused" in error_of(info.value)["message"]
        with pytest.raises(openai.ConflictError):
            oai.fine_tuning.jobs.cancel(job.id)

    def test_a_paused_job_can_be_cancelled_for_good(self, oai: openai.OpenAI, chat_file: str) -> None:
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file)
        oai.fine_tuning.jobs.pause(job.id)
        assert oai.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        with pytest.raises(openai.ConflictError):
            oai.fine_tuning.jobs.resume(job.id)

    def test_resume_runs_a_new_jobs_checks_and_a_refusal_leaves_the_job_paused(
            self, oai: openai.OpenAI, client: TestClient, chat_file: str) -> None:
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file)
        oai.fine_tuning.jobs.pause(job.id)
        assert oai.files.delete(chat_file).deleted is True  # a paused job holds no file
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.jobs.resume(job.id)
        assert error_of(info.value)["param"] == "training_file"
        assert oai.fine_tuning.jobs.retrieve(job.id).status == "paused"
        assert client.get(f"/v1/jobs/{job.id}").json()["status"] == "cancelled"

    def test_someone_elses_job_cannot_be_paused(self, oai: openai.OpenAI, client: TestClient, store,
                                                chat_file: str) -> None:
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file)
        with openai.OpenAI(base_url="http://testserver/openai/v1", api_key=make_user(store, "bob"),
                           http_client=client, max_retries=0) as bob:
            with pytest.raises(openai.NotFoundError) as info:  # not 403: the id is not confirmed
                bob.fine_tuning.jobs.pause(job.id)
            assert error_of(info.value)["message"] == f"No such fine-tuning job: {job.id}"
            assert oai.fine_tuning.jobs.retrieve(job.id).status == "queued"


class TestRefusals:
    @pytest.mark.parametrize(("fields", "param", "needle"), [
        ({"method": {"type": "reinforcement"}}, "method.reinforcement.grader", "needs a grader"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "use 'auto', or"),
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}}},
         "method.dpo.hyperparameters.beta", "greater than 0"),
        ({"method": {"type": "dpo"}}, "training_file", "preference records"),
        ({"suffix": "a b"}, "suffix", "letters, digits"),
        ({"integrations": [{"type": "mlflow", "mlflow": {}}]}, "integrations.0.type", "'wandb'"),
        ({"integrations": [{"type": "wandb", "wandb": {}}]}, "integrations.0.wandb.project", "Missing required"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "a/b"}}]}, None, "tracking.wandb_project"),
        ({"model": "gpt-4o-mini-2024-07-18"}, "model", "gpt-4o-mini"),
        ({"hyperparameters": {"n_epochs": 1}, "method": {"type": "supervised"}}, "hyperparameters", "not both"),
        ({"method": {"type": "supervised", "dpo": {}}}, "method.dpo", "put the settings under method.supervised"),
        ({"training_file": "file-000000000000000000000000"}, "training_file", "no file"),
    ])
    def test_bad_bodies_answer_openai_errors(self, oai: openai.OpenAI, chat_file: str, fields, param, needle) -> None:
        body = {"model": "tiny", "training_file": chat_file, **fields}
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.jobs.create(**body)
        error = error_of(info.value)
        assert error["param"] == param and needle in error["message"], error

    def test_an_unknown_argument_is_named(self, oai: openai.OpenAI, chat_file: str) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.jobs.create(model="tiny", training_file=chat_file, extra_body={"learning_rate": 1})
        assert error_of(info.value)["message"] == "Unrecognized request argument supplied: learning_rate"

    def test_unknown_job_and_route_are_404s(self, oai: openai.OpenAI) -> None:
        with pytest.raises(openai.NotFoundError) as info:
            oai.fine_tuning.jobs.retrieve("job-000000000000000000000000")
        assert error_of(info.value)["param"] == "job_id"
        with pytest.raises(openai.NotFoundError):
            oai.batches.list()

    def test_a_wrong_key_is_a_401(self, client: TestClient) -> None:
        with openai.OpenAI(base_url="http://testserver/openai/v1", api_key="ftq_00000000_" + "x" * 30,
                           http_client=client, max_retries=0) as sdk:
            with pytest.raises(openai.AuthenticationError) as info:
                sdk.files.list()
        error = error_of(info.value)
        assert error["type"] == "authentication_error" and error["param"] == "Authorization"
        assert info.value.response.headers["www-authenticate"].startswith("Bearer")
