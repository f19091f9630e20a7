"""OpenAI's reinforcement fine-tuning with the official ``openai`` client, end to end: a real
uvicorn API and Celery worker (PostgreSQL + Redis), a prompts file uploaded as OpenAI's
reinforcement files are (purpose ``fine-tune``, no format named), ``method: reinforcement`` with a
``string_check`` grader, the job trained by the worker's trainer on the CPU (rollouts sampled and
graded each step) to ``succeeded``, and each step's reward fields read back through
``fine_tuning.jobs.list_events``.

What it does not assert: that the reward rises. OpenAI's route trains LoRA (ftq's defaults,
docs/openai.md: no request field asks for full fine-tuning), and a LoRA on the tiny random-weight
model, its head frozen, barely moves a token's probability: tests/unit/trainer/test_grpo.py learns
this reward with ``method: full``, which only the native ``/v1/jobs`` can ask for. The route's
``grpo.max_new_tokens`` is the default 256 (no OpenAI hyperparameter sets it), so
``compute_multiplier`` 0.25 (groups of 2) and one epoch of four prompts keep the job to two steps
(~11 s of the test's time here, the stack's start ~16 s more).
"""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from tests.fixtures.stack import MODEL, Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.parametrize("stack", ["postgres"], indirect=True)]
# peft still reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model.
pytestmark.append(pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"))

FINISHED = ("succeeded", "failed", "cancelled")
PROMPTS = ("Tell me a story.", "Describe the sea.", "Name a colour.", "Say something.")
GRADER = {"type": "string_check", "name": "says the", "input": "{{sample.output_text}}",
          "reference": "{{item.target}}", "operation": "like"}
NEW_TOKENS = 256
"""``grpo.max_new_tokens`` of a job made by OpenAI's route (GrpoConfig's default)."""


def _wait(client: openai.OpenAI, job_id: str, stack: Stack, timeout_s: float = 240) -> Any:
    deadline = time.monotonic() + timeout_s
    job = client.fine_tuning.jobs.retrieve(job_id)
    while job.status not in FINISHED:
        assert time.monotonic() < deadline, f"{job_id} stayed {job.status}\n{stack.log_tail()}"
        time.sleep(0.3)
        job = client.fine_tuning.jobs.retrieve(job_id)
    return job


def test_a_reinforcement_job_trains_to_success_with_its_rewards_in_the_events(stack: Stack) -> None:
    records = [{"messages": [{"role": "user", "content": p}], "target": " the"} for p in PROMPTS]
    with openai.OpenAI(base_url=f"{stack.url}/openai/v1", api_key=stack.api_key, max_retries=0) as client:
        upload = client.files.create(file=("rft.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode()),
                                     purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model=MODEL, training_file=upload.id, seed=5, method={
            "type": "reinforcement",
            "reinforcement": {"grader": GRADER, "hyperparameters": {
                "n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25}}})
        assert job.status == "queued" and job.method.type == "reinforcement", job
        job = _wait(client, job.id, stack)
        assert job.status == "succeeded", f"{job}\n{stack.log_tail()}"
        assert job.fine_tuned_model and job.method.reinforcement.grader.name == "says the"
        assert job.method.reinforcement.hyperparameters.compute_multiplier == 0.25
        events = list(client.fine_tuning.jobs.list_events(job.id, limit=50))

    assert events[0].message == "The job has successfully completed"
    steps = sorted((e.data for e in events if e.type == "metrics" and "train_loss" in e.data), key=lambda d: d["step"])
    assert steps and [s["step"] for s in steps] == list(range(1, steps[0]["total_steps"] + 1)), events
    for step in steps:
        assert 0.0 <= step["reward_mean"] <= 1.0 and step["reward_std"] >= 0.0, step
        assert 0.0 <= step["zero_std_fraction"] <= 1.0 and step["grade_error_fraction"] == 0.0, step
        assert 0 < step["completion_length"] <= NEW_TOKENS, step
        assert "kl" not in step and step["train_mean_token_accuracy"] is None, step  # beta 0; no token accuracy
