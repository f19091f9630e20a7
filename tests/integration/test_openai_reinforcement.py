"""OpenAI's reinforcement fine-tuning at ``/openai/v1`` (the official client, in-process app, both
stores): a reinforcement file uploads as ``prompts`` with no format named, ``method: reinforcement``
becomes a native ``grpo`` job with the request's grader, and any GRPO job reads back as a
reinforcement job. The GRPO job trains end to end in tests/integration/e2e/test_grpo_e2e.py, and
through this route with the official client in e2e/test_openai_e2e.py (test_a_reinforcement_job_...)."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

pytestmark = pytest.mark.integration

RECORD = {"messages": [{"role": "user", "content": "What is 7 + 5? Answer with the number only."}], "answer": "12"}
GRADER = {"type": "string_check", "name": "right", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
          "operation": "like"}


@pytest.fixture
def prompts_file(oai: openai.OpenAI) -> str:
    content = "".join(json.dumps(RECORD) + "\n" for _ in range(40)).encode()
    return oai.files.create(file=("rft.jsonl", content), purpose="fine-tune").id


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_a_reinforcement_file_uploads_as_prompts(oai: openai.OpenAI, client: TestClient, prompts_file: str) -> None:
    row = client.get(f"/v1/files/{prompts_file}").json()
    assert (row["format"], row["num_records"]) == ("prompts", 40), row
    with pytest.raises(openai.BadRequestError) as info:  # neither a dataset nor prompts: the dataset's reason
        oai.files.create(file=("bad.jsonl", b'{"messages": [{"role": "user", "content": "x"}]}\n{"x": 1}\n'),
                         purpose="fine-tune")
    assert _error(info.value)["message"].startswith("line 1: ")


def test_a_reinforcement_job_is_a_grpo_job_with_its_grader(oai: openai.OpenAI, client: TestClient,
                                                          prompts_file: str) -> None:
    job = oai.fine_tuning.jobs.create(model="tiny", training_file=prompts_file, method={
        "type": "reinforcement",
        "reinforcement": {"grader": GRADER, "hyperparameters": {"compute_multiplier": 0.5, "n_epochs": 2}}})
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.type == "string_check"
    assert job.method.reinforcement.hyperparameters.compute_multiplier == 0.5
    spec = client.get(f"/v1/jobs/{job.id}").json()["spec"]
    assert spec["objective"] == "grpo" and spec["grpo"]["graders"] == GRADER and spec["grpo"]["group_size"] == 4
    assert spec["hyperparameters"]["epochs"] == 2.0
    assert spec["hyperparameters"]["batch_tokens"] >= 4 * (len(RECORD["messages"][0]["content"]) + 64 + 256)
    native = client.post("/v1/jobs", json={**{k: spec[k] for k in ("model", "training_file", "objective", "grpo")},
                                           "hyperparameters": {"max_steps": 3, "batch_tokens": 4096}})
    assert native.status_code == 201, native.text
    shown = oai.fine_tuning.jobs.retrieve(native.json()["id"])
    assert shown.method.type == "reinforcement" and shown.method.reinforcement.grader.name == "right"
    assert shown.method.reinforcement.hyperparameters.compute_multiplier == 0.5


@pytest.mark.parametrize(("method", "param", "needle"), [
    ({"type": "reinforcement"}, "method.reinforcement.grader", "needs a grader"),
    ({"type": "reinforcement", "reinforcement": {"grader": {**GRADER, "operation": "contains"}}},
     "grpo.graders.operation", "operation"),
    ({"type": "reinforcement", "reinforcement": {"grader": {
        "type": "score_model", "name": "judge", "model": "tiny", "input": [{"role": "user", "content": "Rate it"}]}}},
     "grpo.graders.type", "judge model"),
    ({"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {"eval_interval": 5}}},
     "method.reinforcement.hyperparameters.eval_interval", "no evals"),
    ({"type": "supervised"}, "training_file", "prompts records"),
])
def test_bad_reinforcement_bodies_answer_openai_errors(oai: openai.OpenAI, prompts_file: str, method, param,
                                                       needle) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.fine_tuning.jobs.create(model="tiny", training_file=prompts_file, method=method)
    error = _error(info.value)
    assert error["param"] == param and needle in error["message"], error
