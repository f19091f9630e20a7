"""api.errors: one envelope for domain, validation and HTTP errors."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from api.errors import add_exception_handlers, status_for
from core.errors import Conflict, InvalidDataset, InvalidInput, NotFound, TooLarge, Unavailable, Unsupported
from core.jobs.spec import JobSpec


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 1


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inner: Inner = Inner()


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/jobs")
    def submit(spec: JobSpec) -> dict:
        return {}

    @app.post("/body")
    def body(b: Body) -> dict:
        return {}

    @app.get("/raise/{kind}")
    def boom(kind: str) -> dict:
        raise {
            "dataset": InvalidDataset("line 3: bad", line=3),
            "conflict": Conflict("busy", param="job_id"),
            "missing": NotFound("no such"),
        }[kind]

    return TestClient(app)


@pytest.mark.parametrize(
    ("error", "status"),
    [(NotFound("x"), 404), (TooLarge("x"), 413), (InvalidInput("x"), 422), (Unsupported("x"), 422),
     (InvalidDataset("x"), 422), (Conflict("x"), 409), (Unavailable("x"), 503)],
)
def test_status_by_error_type(error: Exception, status: int) -> None:
    assert status_for(error) == status


def test_domain_errors_keep_code_param_and_line(client: TestClient) -> None:
    response = client.get("/raise/dataset")
    assert (response.status_code, response.json()) == (
        422, {"error": {"code": "invalid_dataset", "message": "line 3: bad", "param": None, "line": 3}}
    )
    assert client.get("/raise/conflict").json()["error"]["param"] == "job_id"
    assert client.get("/raise/missing").status_code == 404


def test_unknown_nested_field_lists_the_known_ones(client: TestClient) -> None:
    response = client.post("/body", json={"inner": {"sise": 2}})
    error = response.json()["error"]
    assert response.status_code == 422
    assert error["param"] == "inner.sise"
    assert error["message"] == "inner.sise: unknown field, remove it or fix its spelling; known fields here: size"


def test_several_problems_are_all_listed(client: TestClient) -> None:
    response = client.post("/jobs", json={"model": "m/m", "training_file": "file-" + "0" * 24,
                                          "lora": {"r": 0, "alpha": 0}})
    error = response.json()["error"]
    assert error["message"].startswith("lora.r: Input should be greater than or equal to 1 (got 0)")
    assert "(and 1 more problem: see details)" in error["message"]
    assert [d["param"] for d in error["details"]] == ["lora.r", "lora.alpha"]


def test_a_cross_field_message_loses_the_pydantic_prefix_and_names_its_field(client: TestClient) -> None:
    response = client.post("/jobs", json={"model": "m/m", "training_file": "file-" + "0" * 24,
                                          "hyperparameters": {"max_steps": 1, "epochs": 1}})
    assert response.json()["error"]["message"] == (
        "hyperparameters.epochs: set max_steps or epochs, not both (remove one of them)"
    )
    assert response.json()["error"]["param"] == "hyperparameters.epochs"
