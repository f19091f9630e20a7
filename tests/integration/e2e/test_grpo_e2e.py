"""A GRPO job through the product, on CPU: docs/grpo.md's prompts file uploaded with
``format=prompts``, its job body submitted over ``POST /v1/jobs`` to a real stack (PostgreSQL,
Redis, ``ftq api``, ``ftq worker``), its rollouts sampled and graded in the trainer, its reward
fields in the step events (SSE) and in ``/metrics``, its first rollouts of each step in the stream and at
``/rollouts``. The refusals before queueing are ``tests/integration/test_api_jobs_grpo.py``'s
(in-process app, both stores)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.fixtures.stack import MODEL
from tests.fixtures.stack_jobs import follow
from trainer.objectives import declaration

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("stack", ["postgres"], indirect=True)]

STEPS = 3
DOC = Path(__file__).resolve().parents[3] / "docs" / "grpo.md"


def _doc_block(language: str) -> str:
    """The first fenced block of ``language`` in docs/grpo.md (its example, submitted as written)."""
    match = re.search(rf"^```{language}\n(.*?)^```$", DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert match is not None, f"docs/grpo.md has no {language} block"
    return match.group(1)


def test_the_docs_grpo_job_trains_to_success_with_its_rewards_in_steps_and_metrics(stack, tmp_path: Path) -> None:
    """docs/grpo.md's prompts file and job body, with the stack's tiny model and 3 steps."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(_doc_block("jsonl"))
    body = json.loads(_doc_block("json"))
    with stack.client() as client:
        with prompts.open("rb") as f:
            uploaded = client.post("/v1/files", files={"file": (prompts.name, f, "application/jsonl")},
                                   data={"purpose": "train", "format": "prompts"})
        assert uploaded.status_code == 201 and uploaded.json()["format"] == "prompts", uploaded.text
        body.update(model=MODEL, training_file=uploaded.json()["id"])
        body["hyperparameters"]["max_steps"] = STEPS
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        job = response.json()
        assert job["preflight"]["checked"] and job["preflight"]["records"] == 2, job["preflight"]

        events = follow(client, job["id"])

        job = client.get(f"/v1/jobs/{job['id']}").json()
        assert job["status"] == "succeeded", f"{job}\n{stack.log_tail()}"
        fields = [m.name for m in declaration("grpo").metrics]
        steps = [data for _, kind, data in events if kind == "step"]
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        for step in steps:
            assert 0.0 <= step["reward_mean"] <= 1.0 and step["grade_error_fraction"] == 0.0, step
            assert 0 < step["completion_length"] <= body["grpo"]["max_new_tokens"], step
            assert step["kl"] is None and step["reward_margin"] is None, step  # beta 0; a DPO field
        rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        assert [{k: row[k] for k in fields} for row in rows] == [{k: s[k] for k in fields} for s in steps]
        # each step's first rollouts (grpo.log_rollouts: 4), live in the stream and stored by the worker
        shown = [data for _, kind, data in events if kind == "rollouts"]
        stored = client.get(f"/v1/jobs/{job['id']}/rollouts").json()["data"]
        assert [r["step"] for r in stored] == [e["step"] for e in shown] == list(range(1, STEPS + 1))
        for page, event in zip(stored, shown):
            assert page["rollouts"] == event["rollouts"] and len(page["rollouts"]) == 4
            assert all(r["reward"] in (0.0, 1.0) and r["scores"] == {"right number": r["reward"]}
                       for r in page["rollouts"]), page
