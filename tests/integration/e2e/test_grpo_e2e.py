"""A GRPO job through the product, on CPU: a prompts file uploaded with ``format=prompts``, the job
submitted over ``POST /v1/jobs`` to a real stack (PostgreSQL, Redis, ``ftq api``, ``ftq worker``),
its rollouts sampled and graded in the trainer, and its reward fields in the step events (SSE) and
in ``/metrics``. The refusals before queueing are ``tests/integration/test_api_jobs_grpo.py``'s
(in-process app, both stores)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.stack import MODEL
from tests.fixtures.stack_jobs import follow
from trainer.objectives import declaration

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("stack", ["postgres"], indirect=True)]

STEPS = 3
GRPO = {"graders": {"type": "string_check", "name": "has e", "input": "{{sample.output_text}}",
                    "reference": "{{item.letter}}", "operation": "ilike"},
        "group_size": 4, "max_new_tokens": 8, "loss_type": "grpo"}


def test_a_grpo_job_trains_to_success_with_its_rewards_in_steps_and_metrics(stack, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    records = [{"prompt": "The cat", "letter": "e"}, {"messages": [{"role": "user", "content": "Hi"}], "letter": "a"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    with stack.client() as client:
        with prompts.open("rb") as f:
            uploaded = client.post("/v1/files", files={"file": (prompts.name, f, "application/jsonl")},
                                   data={"purpose": "train", "format": "prompts"})
        assert uploaded.status_code == 201 and uploaded.json()["format"] == "prompts", uploaded.text
        body = {"model": MODEL, "training_file": uploaded.json()["id"], "objective": "grpo", "method": "lora",
                "grpo": GRPO, "hyperparameters": {"max_steps": STEPS, "learning_rate": 0.01, "batch_tokens": 256,
                                                  "max_seq_len": 64}}
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
            assert 0 < step["completion_length"] <= GRPO["max_new_tokens"], step
            assert step["kl"] is None and step["reward_margin"] is None, step  # beta 0; a DPO field
        rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        assert [{k: row[k] for k in fields} for row in rows] == [{k: s[k] for k in fields} for s in steps]
