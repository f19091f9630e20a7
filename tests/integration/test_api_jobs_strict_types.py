"""Numbers, integers and booleans in a job spec are strict (issue 22 item 9: ``"learning_rate":
"5e-4"`` was accepted). A string where a number is required is a 422 naming the field, on
``POST /v1/jobs``, ``/v1/jobs/preview`` and ``/v1/jobs/{id}/clone``; a whole number where a float
is expected is taken (JSON cannot tell ``1`` from ``1.0``), ``2.0`` where an integer is required is
refused everywhere. The OpenAI route's hyperparameters: an integer or ``"auto"``, not ``"3"``."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.jobs.models import Job
from tests.integration.helpers import spec, upload

pytestmark = pytest.mark.integration


def jobs(store) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(Job))


class TestNativeSpec:
    @pytest.mark.parametrize(
        ("change", "param", "fragment"),
        [
            ({"hyperparameters": {"learning_rate": "5e-4"}}, "hyperparameters.learning_rate",
             "Input should be a valid number (got '5e-4'); send a JSON number, without quotes"),
            ({"hyperparameters": {"max_steps": "10"}}, "hyperparameters.max_steps",
             "send a JSON integer, without quotes"),
            ({"hyperparameters": {"max_steps": 2.0}}, "hyperparameters.max_steps",
             "(got 2.0); send a whole number, without a decimal point"),
            ({"lora": {"r": "8"}}, "lora.r", "valid integer"),
            ({"dpo": {"beta": "0.1"}, "objective": "dpo"}, "dpo.beta", "valid number"),
            ({"tracking": {"tensorboard": "true"}}, "tracking.tensorboard", "send true or false, without quotes"),
            ({"tracking": {"tensorboard": 1}}, "tracking.tensorboard", "valid boolean"),
            ({"gpus": True}, "gpus", "valid integer"),
            ({"max_gpu_memory_gb": "40"}, "max_gpu_memory_gb", "valid number"),
        ],
    )
    def test_a_string_or_a_float_where_a_number_or_integer_is_required_is_422_naming_the_field(
        self, client: TestClient, store, change: dict, param: str, fragment: str
    ) -> None:
        body = spec(upload(client))
        body.update(change)
        for route in ("/v1/jobs", "/v1/jobs/preview"):
            response = client.post(route, json=body)
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["param"] == param and fragment in error["message"], error
        assert jobs(store) == 0

    def test_a_whole_number_where_a_float_is_expected_is_accepted_and_stored_as_a_float(
        self, client: TestClient, store
    ) -> None:
        body = spec(upload(client), max_gpu_memory_gb=40)
        body["hyperparameters"] = {"epochs": 2, "learning_rate": 1, "weight_decay": 0}
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        stored = response.json()["spec"]
        assert stored["hyperparameters"]["epochs"] == 2.0 and isinstance(stored["hyperparameters"]["epochs"], float)
        assert stored["max_gpu_memory_gb"] == 40.0

    def test_a_clone_with_a_string_for_a_number_is_422_naming_the_field(self, client: TestClient, store) -> None:
        source = client.post("/v1/jobs", json=spec(upload(client)))
        assert source.status_code == 201, source.text
        response = client.post(f"/v1/jobs/{source.json()['id']}/clone",
                               json={"hyperparameters": {"learning_rate": "1e-4"}})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"] == "hyperparameters.learning_rate"
        assert jobs(store) == 1


class TestOpenAIHyperparameters:
    @pytest.fixture
    def oai(self, client: TestClient, admin_key: str):
        with openai.OpenAI(base_url="http://testserver/openai/v1", api_key=admin_key, http_client=client,
                           max_retries=0) as sdk:
            yield sdk

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"hyperparameters": {"n_epochs": "3"}}, "hyperparameters.n_epochs"),
            ({"hyperparameters": {"learning_rate_multiplier": "0.5"}}, "hyperparameters.learning_rate_multiplier"),
            ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": "4"}}}},
             "method.supervised.hyperparameters.batch_size"),
            ({"hyperparameters": {"n_epochs": 3.0}}, "hyperparameters.n_epochs"),
            ({"seed": "7"}, "seed"),
        ],
    )
    def test_a_string_for_a_number_is_a_400_naming_the_field(self, oai: openai.OpenAI, client: TestClient,
                                                            fields: dict, param: str) -> None:
        training_file = upload(client)
        with pytest.raises(openai.BadRequestError) as info:
            oai.fine_tuning.jobs.create(model="tiny", training_file=training_file, **fields)
        error = info.value.response.json()["error"]
        assert error["param"] == param and "Invalid value for" in error["message"], error

    def test_auto_and_a_whole_number_for_a_float_are_accepted(self, oai: openai.OpenAI, client: TestClient) -> None:
        job = oai.fine_tuning.jobs.create(model="tiny", training_file=upload(client), hyperparameters={
            "n_epochs": "auto", "batch_size": 2, "learning_rate_multiplier": 1})
        assert job.hyperparameters.batch_size == 2 and job.hyperparameters.learning_rate_multiplier == 1.0
