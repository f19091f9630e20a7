"""The official ``openai`` client against a real uvicorn API and Celery worker (PostgreSQL +
Redis): a user's OpenAI fine-tuning script with three lines changed trains a tiny model.

Upload, a supervised job to ``succeeded`` (events newest first, checkpoints with metrics, the
metrics CSV as a result file), a failed job's ``error``, pause and resume (the job continues
from its checkpoint with no gap in its steps) then cancel of the running job, a DPO job to ``succeeded`` with its reward metrics,
bad files and bodies answered in OpenAI's error shape, ``models.list``/``retrieve`` naming the
tuned jobs, and a ``method: reinforcement`` job (a prompts file, a ``string_check`` grader) to
``succeeded`` with each step's reward fields in its events. One stack for the module.

What the reinforcement test does not assert: that the reward rises. OpenAI's route trains LoRA
(ftq's defaults, docs/openai.md: no request field asks for full fine-tuning), and a LoRA on the
tiny random-weight model, its head frozen, barely moves a token's probability:
tests/unit/trainer/test_grpo.py learns this reward with ``method: full``, which only the native
``/v1/jobs`` can ask for. The route's ``grpo.max_new_tokens`` is the default 256 (no OpenAI
hyperparameter sets it), so ``compute_multiplier`` 0.25 (groups of 2) and one epoch of four
prompts keep the job to two steps (~11 s here).
"""

from __future__ import annotations

import csv
import io
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fixtures.e2e_stacks import postgres_stack
from tests.fixtures.stack import Stack
from tests.fixtures.training_inputs import WORDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# peft still reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model.
pytestmark.append(pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"))

FINISHED = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def oa_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    yield from postgres_stack(tmp_path_factory.mktemp("openai"), model_root)


@pytest.fixture(scope="module")
def client(oa_stack: Stack) -> Iterator[openai.OpenAI]:
    # The three lines that change in a user's script: the base URL, the key, the model name.
    with openai.OpenAI(base_url=f"{oa_stack.url}/openai/v1", api_key=oa_stack.api_key, max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def train_file(client: openai.OpenAI, chat_dataset: Path) -> str:
    with chat_dataset.open("rb") as f:
        return client.files.create(file=f, purpose="fine-tune").id


@pytest.fixture(scope="module")
def preference_file(client: openai.OpenAI) -> str:
    rng = random.Random(1)
    lines = []
    for _ in range(32):
        prompt = " ".join(rng.choices(WORDS, k=6))
        lines.append(json.dumps({
            "input": {"messages": [{"role": "user", "content": prompt}]},
            "preferred_output": [{"role": "assistant", "content": " ".join(rng.choices(WORDS[:8], k=8))}],
            "non_preferred_output": [{"role": "assistant", "content": " ".join(rng.choices(WORDS[8:], k=8))}],
        }))
    return client.files.create(file=("pairs.jsonl", "\n".join(lines).encode()), purpose="fine-tune").id


def wait(client: openai.OpenAI, job_id: str, statuses: tuple[str, ...], stack: Stack,
         timeout_s: float = 240) -> Any:
    deadline = time.monotonic() + timeout_s
    job = client.fine_tuning.jobs.retrieve(job_id)
    while job.status not in statuses:
        assert time.monotonic() < deadline, f"{job_id} stayed {job.status}\n{stack.log_tail()}"
        time.sleep(0.3)
        job = client.fine_tuning.jobs.retrieve(job_id)
    return job


def wait_steps(client: openai.OpenAI, job_id: str, n: int, stack: Stack, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(e.type == "metrics" and (e.data or {}).get("step", 0) >= n
                  for e in client.fine_tuning.jobs.list_events(job_id, limit=5)):
        assert time.monotonic() < deadline, f"{job_id} never reached step {n}\n{stack.log_tail()}"
        time.sleep(0.3)


def all_events(client: openai.OpenAI, job_id: str) -> list[Any]:
    return list(client.fine_tuning.jobs.list_events(job_id, limit=50))


def test_a_supervised_job_succeeds_with_events_checkpoints_and_results(client, oa_stack, train_file, chat_dataset):
    with chat_dataset.open("rb") as f:
        valid = client.files.create(file=("valid.jsonl", f.read()[:2000].rsplit(b"\n", 1)[0]), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=train_file, validation_file=valid.id, suffix="e2e", seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 16}}},
    )
    assert job.status == "queued" and job.hyperparameters.n_epochs == 2
    job = wait(client, job.id, FINISHED, oa_stack)
    assert job.status == "succeeded", f"{job}\n{oa_stack.log_tail()}"
    assert job.fine_tuned_model == f"ft:tiny-llama:e2e:e2e:{job.id}"
    assert job.trained_tokens and job.trained_tokens > 0 and job.finished_at and job.error is None

    events = all_events(client, job.id)
    seqs = [int(e.id.rsplit("-", 1)[1]) for e in events]
    assert seqs == sorted(seqs, reverse=True), "events are listed newest first"
    assert events[0].message == "The job has successfully completed"
    metrics = [e.data for e in events if e.type == "metrics" and "train_loss" in e.data]
    steps = sorted(m["step"] for m in metrics)
    assert steps == list(range(1, len(steps) + 1)) and all(m["train_loss"] > 0 for m in metrics)
    assert all(0.0 <= m["train_mean_token_accuracy"] <= 1.0 for m in metrics)
    assert any(e.type == "metrics" and "valid_loss" in e.data for e in events)

    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints and checkpoints[0].step_number == steps[-1]
    assert checkpoints[0].metrics.train_loss > 0 and checkpoints[0].metrics.valid_loss > 0
    assert 0.0 <= checkpoints[0].metrics.train_mean_token_accuracy <= 1.0
    assert 0.0 <= checkpoints[0].metrics.valid_mean_token_accuracy <= 1.0
    assert checkpoints[0].fine_tuned_model_checkpoint.endswith(f":ckpt-step-{steps[-1]}")

    [result] = job.result_files
    assert client.files.retrieve(result).purpose == "fine-tune-results"
    rows = list(csv.reader(io.StringIO(client.files.content(result).text)))
    assert rows[0] == ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]
    assert [int(r[0]) for r in rows[1:]] == steps and rows[-1][3] != ""
    assert all(0.0 <= float(r[2]) <= 1.0 for r in rows[1:]), "train_accuracy is the step's token accuracy"
    assert 0.0 <= float(rows[-1][4]) <= 1.0, "the last step was evaluated"

    with oa_stack.client() as native:  # one store: the native API has the same job
        assert native.get(f"/v1/jobs/{job.id}").json()["status"] == "succeeded"


def test_a_failed_job_says_why_in_error(client, oa_stack, train_file):
    job = client.fine_tuning.jobs.create(model=oa_stack.corrupt_model, training_file=train_file)
    failed = wait(client, job.id, FINISHED, oa_stack)
    assert failed.status == "failed" and failed.error is not None, f"{failed}\n{oa_stack.log_tail()}"
    assert failed.error.code and failed.error.message and failed.fine_tuned_model is None
    assert any(e.level == "error" for e in all_events(client, job.id))


def test_pause_then_resume_continues_from_the_checkpoint_and_cancel_stops_it(client, oa_stack, train_file):
    # Long enough (hundreds of steps) that neither run can end by itself before it is stopped.
    job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file,
                                         hyperparameters={"n_epochs": 50, "batch_size": 1})
    wait_steps(client, job.id, 2, oa_stack)
    running = client.fine_tuning.jobs.retrieve(job.id)
    assert running.status == "running" and running.estimated_finish >= running.created_at  # from its pace
    client.fine_tuning.jobs.pause(job.id)
    paused = wait(client, job.id, ("paused", "succeeded", "failed"), oa_stack)
    assert paused.status == "paused", f"{paused}\n{oa_stack.log_tail()}"
    stop = client.fine_tuning.jobs.checkpoints.list(job.id).data[0].step_number

    assert client.fine_tuning.jobs.resume(job.id).status == "queued"
    wait_steps(client, job.id, stop + 2, oa_stack)
    client.fine_tuning.jobs.cancel(job.id)
    cancelled = wait(client, job.id, FINISHED, oa_stack)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None and cancelled.error is None

    messages = [e.message for e in all_events(client, job.id)]
    assert any("resumed" in m for m in messages) and any("paused" in m for m in messages)
    with oa_stack.client() as native:
        rows = native.get(f"/v1/jobs/{job.id}/metrics", params={"limit": 10000}).json()["data"]
        plans = [json.loads(d) for d in _plans(native, job.id)]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "no gap and no repeat across the pause"
    assert len(rows) > stop + 1
    assert [p["resumed_from_step"] for p in plans] == [None, stop]


def _plans(native, job_id: str) -> list[str]:
    """The ``plan`` events' data from the native SSE history (the stream ends with the job)."""
    out, kind = [], None
    with native.stream("GET", f"/v1/jobs/{job_id}/events", timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("event:"):
                kind = line.partition(":")[2].strip()
            elif line.startswith("data:") and kind == "plan":
                out.append(line.partition(":")[2].strip())
    return out


def test_a_dpo_job_succeeds_with_reward_metrics(client, oa_stack, preference_file):
    job = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=preference_file,
        method={"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 2, "batch_size": 8, "beta": 0.2}}},
    )
    assert job.method.dpo.hyperparameters.beta == 0.2
    job = wait(client, job.id, FINISHED, oa_stack)
    assert job.status == "succeeded", f"{job}\n{oa_stack.log_tail()}"
    metrics = [e.data for e in all_events(client, job.id) if e.type == "metrics" and "train_loss" in e.data]
    assert metrics
    for data in metrics:
        assert {"reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp"} <= set(data), data
        assert 0.0 <= data["reward_accuracy"] <= 1.0 and data["train_mean_token_accuracy"] is None


def test_bad_files_and_bodies_answer_openai_errors(client, train_file):
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("bad.jsonl", b'{"messages": [{"role": "user", "content": "x"}]}\n{"x": 1}\n'),
                            purpose="fine-tune")
    error = info.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"].startswith("line 1: ")
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file,
                                       method={"type": "reinforcement"})
    assert info.value.response.json()["error"]["param"] == "method.reinforcement.grader"
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("job-000000000000000000000000")


def test_models_list_and_retrieve_show_the_bases_and_the_tuned_jobs(client, oa_stack, train_file):
    """``models.list`` / ``models.retrieve`` on the real stack, over the jobs this module's tests made
    (a short job of its own when it runs alone): no other stack, no other training in a full run."""
    succeeded = [j for j in client.fine_tuning.jobs.list(limit=100) if j.status == "succeeded"]
    if not succeeded:
        job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file, suffix="models", seed=1,
                                             hyperparameters={"n_epochs": 1})
        succeeded = [wait(client, job.id, FINISHED, oa_stack)]
        assert succeeded[0].status == "succeeded", f"{succeeded[0]}\n{oa_stack.log_tail()}"
    models = {m.id: m for m in client.models.list()}
    assert models["tiny-llama"].owned_by == "ftq" and models["tiny-llama"].object == "model"
    for job in succeeded:
        checkpoints = [c.fine_tuned_model_checkpoint for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
        assert {job.fine_tuned_model, *checkpoints} <= set(models), (job.fine_tuned_model, sorted(models))
        retrieved = client.models.retrieve(job.fine_tuned_model)
        assert retrieved == models[job.fine_tuned_model]
        assert (retrieved.created, retrieved.owned_by) == (job.finished_at, job.fine_tuned_model.split(":")[2])
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve(f"{succeeded[0].fine_tuned_model}:ckpt-step-999999")
    assert info.value.response.json()["error"]["param"] == "model"


RFT_PROMPTS = ("Tell me a story.", "Describe the sea.", "Name a colour.", "Say something.")
RFT_GRADER = {"type": "string_check", "name": "says the", "input": "{{sample.output_text}}",
              "reference": "{{item.target}}", "operation": "like"}
RFT_NEW_TOKENS = 256
"""``grpo.max_new_tokens`` of a job made by OpenAI's route (GrpoConfig's default)."""


def test_a_reinforcement_job_trains_to_success_with_its_rewards_in_the_events(client, oa_stack):
    records = [{"messages": [{"role": "user", "content": p}], "target": " the"} for p in RFT_PROMPTS]
    upload = client.files.create(file=("rft.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode()),
                                 purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=upload.id, seed=5, method={
        "type": "reinforcement",
        "reinforcement": {"grader": RFT_GRADER, "hyperparameters": {
            "n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25}}})
    assert job.status == "queued" and job.method.type == "reinforcement", job
    job = wait(client, job.id, FINISHED, oa_stack)
    assert job.status == "succeeded", f"{job}\n{oa_stack.log_tail()}"
    assert job.fine_tuned_model and job.method.reinforcement.grader.name == "says the"
    assert job.method.reinforcement.hyperparameters.compute_multiplier == 0.25
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=50))

    assert events[0].message == "The job has successfully completed"
    steps = sorted((e.data for e in events if e.type == "metrics" and "train_loss" in e.data), key=lambda d: d["step"])
    assert steps and [s["step"] for s in steps] == list(range(1, steps[0]["total_steps"] + 1)), events
    for step in steps:
        assert 0.0 <= step["reward_mean"] <= 1.0 and step["reward_std"] >= 0.0, step
        assert 0.0 <= step["zero_std_fraction"] <= 1.0 and step["grade_error_fraction"] == 0.0, step
        assert 0 < step["completion_length"] <= RFT_NEW_TOKENS, step
        assert "kl" not in step and step["train_mean_token_accuracy"] is None, step  # beta 0; no token accuracy


CHAT = [{"role": "user", "content": "Tell me a story."}]


def _tuned_model(client: openai.OpenAI, oa_stack: Stack, train_file: str) -> str:
    """A succeeded job's ``fine_tuned_model`` from this module's earlier tests (a short job when run alone)."""
    succeeded = [j for j in client.fine_tuning.jobs.list(limit=100) if j.status == "succeeded"]
    if not succeeded:
        job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file, suffix="chat", seed=1,
                                             hyperparameters={"n_epochs": 1})
        succeeded = [wait(client, job.id, FINISHED, oa_stack)]
        assert succeeded[0].status == "succeeded", f"{succeeded[0]}\n{oa_stack.log_tail()}"
    return succeeded[-1].fine_tuned_model


def _sampler_greedy(oa_stack: Stack, session_id: str, messages: list[dict], max_tokens: int) -> tuple[list[str], str]:
    """The sampler's own greedy tokens (as text pieces) and text for ``messages``, on what the session loaded
    (its job.json: the base and the job's adapter)."""
    import torch

    from trainer.generate.chat import render_messages
    from trainer.generate.engine import Engine
    from trainer.generate.params import Request, SamplingParams
    from trainer.generate.session import load_session_model
    from trainer.generate.session_config import SessionConfig

    config = SessionConfig.load(oa_stack.data_dir / "jobs" / session_id / "job.json")
    model, tokenizer = load_session_model(config, torch.device("cpu"))
    ids = tuple(render_messages(tokenizer, messages))
    (adapter,) = config.adapters
    [result] = Engine(model, tokenizer, slots=1, max_len=config.max_len).generate(
        [Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), adapter=adapter)])
    completion = result.completions[0]
    return [tokenizer.decode([t]) for t in completion.token_ids], completion.text


def test_chat_and_completions_answer_from_a_session_of_the_tuned_model(client, oa_stack, train_file):
    """The official client's ``chat.completions.create`` (whole and streamed) and ``completions.create``
    on a job's ``fine_tuned_model``: the first request starts a session (a job of kind ``session`` on the
    worker) and waits while it loads; greedy tokens over the route equal the sampler's own for the
    same prompt; bad input answers OpenAI's errors; ``DELETE /v1/sessions/{id}`` ends it (drained)."""
    model = _tuned_model(client, oa_stack, train_file)
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                           top_logprobs=2)
    [choice] = whole.choices
    assert whole.object == "chat.completion" and whole.model == model and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and whole.usage.prompt_tokens > 0
    assert whole.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)

    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage == whole.usage
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason

    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, n=2, seed=1)
    assert text.object == "text_completion" and [c.index for c in text.choices] == [0, 1]
    assert text.choices[0].text == text.choices[1].text and text.usage.completion_tokens > 0  # greedy: alike

    with oa_stack.client() as native:
        [session] = native.get("/v1/sessions").json()["data"]
        assert session["ready"] and session["status"] == "running" and session["models"][0].startswith("job:")
        pieces, sampler_text = _sampler_greedy(oa_stack, session["id"], CHAT, 12)
        assert [t.token for t in choice.logprobs.content] == pieces, "the route's greedy tokens are the sampler's"
        assert choice.message.content == sampler_text

        for bad, param, error in ((dict(model="no-such-model"), "model", openai.NotFoundError),
                                  (dict(model=model, temperature=5), "temperature", openai.BadRequestError),
                                  (dict(model=model, max_tokens=30_000), "messages", openai.BadRequestError)):
            with pytest.raises(error) as refused:
                client.chat.completions.create(**{"messages": CHAT, **bad})
            assert refused.value.response.json()["error"]["param"] == param, refused.value.response.json()
        assert refused.value.code == "context_length_exceeded"

        bob = oa_stack.create_user("bob-chat")
        with openai.OpenAI(base_url=f"{oa_stack.url}/openai/v1", api_key=bob, max_retries=0) as other:
            with pytest.raises(openai.NotFoundError) as refused:
                other.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
        assert refused.value.code == "model_not_found", "another user's model is unknown to them"

        env = {**oa_stack.env, "FTQ_API_URL": oa_stack.url, "FTQ_API_KEY": oa_stack.api_key}
        one_shot = subprocess.run([sys.executable, "-m", "cli", "chat", model, "-m", CHAT[0]["content"],
                                   "--max-tokens", "12", "--temperature", "0"], env=env, capture_output=True,
                                  text=True, timeout=120, check=False)
        assert one_shot.returncode == 0, one_shot.stderr
        assert one_shot.stdout.rstrip("\n") == choice.message.content.rstrip("\n"), "ftq chat -m: the same answer"

        assert native.delete(f"/v1/sessions/{session['id']}").status_code == 202
        deadline = time.monotonic() + 60
        while (ended := native.get(f"/v1/sessions/{session['id']}").json())["status"] == "running":
            assert time.monotonic() < deadline, oa_stack.log_tail()
            time.sleep(0.2)
        assert ended["status"] == "cancelled", ended
