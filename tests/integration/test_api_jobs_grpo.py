"""GRPO at the API: a prompts file is a training file when uploaded with ``format=prompts``; a GRPO
job's group, completion length, prompts and grader are checked before it is queued, each refusal a
422 naming the field, with nothing stored (``core.jobs.grpo_checks``). The job trains end to end in
``tests/integration/e2e/test_grpo_e2e.py``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.jobs import service
from core.jobs.models import Job
from tests.integration.helpers import spec, upload

pytestmark = pytest.mark.integration

PROMPTS = [{"prompt": "2 + 2 =", "answer": "4"},
           {"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"}]
GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
          "operation": "eq"}


def _upload(client: TestClient, records: list[dict], layout: str = "prompts") -> Any:
    content = "".join(json.dumps(r) + "\n" for r in records)
    return client.post("/v1/files", files={"file": ("p.jsonl", content)}, data={"purpose": "train", "format": layout})


def _grpo(file_id: str, **grpo: Any) -> dict[str, Any]:
    return spec(file_id, objective="grpo", grpo={"graders": GRADER, "group_size": 4, "max_new_tokens": 16, **grpo})


def _jobs(store) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(Job))


class TestPromptsFiles:
    def test_prompts_upload_as_a_training_file_only_when_declared(self, client: TestClient) -> None:
        declared = _upload(client, PROMPTS)
        assert declared.status_code == 201 and declared.json()["format"] == "prompts", declared.text
        assert declared.json()["num_records"] == 2
        detected = _upload(client, PROMPTS, "auto")
        assert detected.status_code == 422 and "'completion' is missing" in detected.text, detected.text

    def test_a_bad_or_empty_prompts_file_is_refused_naming_the_line(self, client: TestClient) -> None:
        bad = _upload(client, [PROMPTS[0], {"messages": [{"role": "robot", "content": "x"}]}])
        assert bad.status_code == 422 and bad.json()["error"]["line"] == 2, bad.text
        empty = client.post("/v1/files", files={"file": ("p.jsonl", "\n")}, data={"purpose": "train", "format": "prompts"})
        assert empty.status_code == 422 and "no prompt" in empty.text, empty.text


class TestGrpoJobs:
    def test_a_grpo_job_is_stored_with_its_section_and_a_checked_preflight(self, client: TestClient) -> None:
        file_id = _upload(client, PROMPTS).json()["id"]
        response = client.post("/v1/jobs", json=_grpo(file_id))
        assert response.status_code == 201, response.text
        job = response.json()
        assert job["spec"]["grpo"]["graders"] == GRADER and job["spec"]["grpo"]["group_size"] == 4
        assert job["preflight"]["checked"] and job["preflight"]["records"] == 2, job["preflight"]

    @pytest.mark.parametrize(("grpo", "param", "says"), [
        ({"group_size": 1}, "grpo.group_size", "greater than or equal to 2"),
        ({"graders": None}, "grpo.graders", "needs a grader"),
        ({"graders": {**GRADER, "operation": "contains"}}, "grpo.graders.operation", "operation"),
        ({"graders": {"type": "score_model", "name": "judge", "model": "tiny",
                      "input": [{"role": "user", "content": "Rate {{sample.output_text}}"}]}},
         "grpo.graders.type", "judge model"),
        ({"graders": {**GRADER, "reference": "{{item.solution}}"}}, "grpo.graders.reference", "solution"),
        ({"graders": {"type": "python", "name": "sneaky",
                      "source": "import subprocess\ndef grade(sample, item):\n    return 1.0"}},
         "grpo.graders", "subprocess"),
        ({"max_new_tokens": 5000}, "grpo.max_new_tokens", "context of 4096"),
        ({"group_size": 64, "max_new_tokens": 512}, "hyperparameters.batch_tokens", "one micro-batch"),
    ])
    def test_a_bad_grpo_job_is_422_naming_the_field_and_nothing_is_stored(
            self, client: TestClient, store, grpo: dict, param: str, says: str) -> None:
        file_id = _upload(client, PROMPTS).json()["id"]
        response = client.post("/v1/jobs", json=_grpo(file_id, **grpo))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"], error
        assert _jobs(store) == 0

    def test_a_chat_file_or_a_validation_file_for_grpo_and_a_grpo_section_for_sft_are_refused(self, client: TestClient) -> None:
        chat = upload(client)
        response = client.post("/v1/jobs", json=_grpo(chat))
        assert response.status_code == 422 and response.json()["error"]["param"] == "training_file", response.text
        assert "prompts" in response.json()["error"]["message"]
        response = client.post("/v1/jobs", json=spec(chat, grpo={"group_size": 4}))
        assert response.status_code == 422 and "objective grpo" in response.text, response.text
        prompts = _upload(client, PROMPTS).json()["id"]
        response = client.post("/v1/jobs", json={**_grpo(prompts), "validation_file": upload(client, purpose="validation")})
        assert response.status_code == 422 and response.json()["error"]["param"] == "validation_file", response.text

    def test_a_grader_that_raises_on_an_empty_completion_is_a_warning(self, client: TestClient) -> None:
        file_id = _upload(client, PROMPTS).json()["id"]
        grader = {"type": "python", "name": "number", "source": "def grade(sample, item):\n"
                  "    return float(sample['output_text'] == item['answer']) + float(sample['output_text'])"}
        response = client.post("/v1/jobs", json=_grpo(file_id, graders=grader))
        assert response.status_code == 201, response.text
        warnings = response.json()["preflight"]["warnings"]
        assert len(warnings) == 2 and all("empty completion" in w for w in warnings), warnings


def _shown(step: int, rewards: list[float]) -> dict[str, Any]:
    """A ``rollouts`` event of ``step`` as the trainer emits it (``trainer.objectives.grpo.shown_rollouts``)."""
    from trainer.events import make_event

    return make_event("rollouts", step=step, rollouts=[
        {"prompt_index": 0, "prompt": "2 + 2 =", "completion": f" {step}{k}", "completion_tokens": 2, "reward": r,
         "advantage": r - 0.5, "scores": {"exact": r}} for k, r in enumerate(rewards)])


class TestRollouts:
    """The trainer's ``rollouts`` events, stored by the worker's recorder, at ``/v1/jobs/{id}/rollouts``."""

    def test_each_steps_rollouts_are_stored_and_served_by_step_and_in_pages(self, client: TestClient, store) -> None:
        from worker.recorder import apply_events

        job_id = client.post("/v1/jobs", json=_grpo(_upload(client, PROMPTS).json()["id"])).json()["id"]
        assert client.get(f"/v1/jobs/{job_id}/rollouts").json() == {"object": "list", "data": [], "next_after_step": None}
        with store.sessions() as session:
            apply_events(session, job_id, [_shown(step, [1.0, 0.0, 0.0, 0.0]) for step in (1, 2, 3)])
            apply_events(session, job_id, [_shown(2, [1.0, 1.0])])  # a resumed run re-emits step 2: it replaces
            session.commit()
        assert client.get(f"/v1/jobs/{job_id}/rollouts/steps").json() == {"steps": [1, 2, 3]}
        [two] = client.get(f"/v1/jobs/{job_id}/rollouts", params={"step": 2}).json()["data"]
        assert [(r["completion"], r["reward"], r["scores"]) for r in two["rollouts"]] == [
            (" 20", 1.0, {"exact": 1.0}), (" 21", 1.0, {"exact": 1.0})]
        first = client.get(f"/v1/jobs/{job_id}/rollouts", params={"limit": 2}).json()
        assert [p["step"] for p in first["data"]] == [1, 2] and first["next_after_step"] == 2
        rest = client.get(f"/v1/jobs/{job_id}/rollouts", params={"limit": 2, "after_step": 2}).json()
        assert [p["step"] for p in rest["data"]] == [3] and rest["next_after_step"] is None
        assert client.get(f"/v1/jobs/{job_id}/rollouts", params={"step": 9}).json()["data"] == []
        with store.sessions() as session:  # kept as events too: the job page's live updates
            assert [e.type for e in service.events_after(session, job_id, 0)].count("rollouts") == 4

    def test_a_bad_page_is_422_naming_the_field_and_an_unknown_job_404(self, client: TestClient) -> None:
        job_id = client.post("/v1/jobs", json=_grpo(_upload(client, PROMPTS).json()["id"])).json()["id"]
        for params, field in (({"limit": 0}, "limit"), ({"limit": 201}, "limit"), ({"step": -1}, "step")):
            response = client.get(f"/v1/jobs/{job_id}/rollouts", params=params)
            assert response.status_code == 422 and response.json()["error"]["param"] == field, response.text
        for path in ("rollouts", "rollouts/steps"):
            assert client.get(f"/v1/jobs/job-nope/{path}").status_code == 404
