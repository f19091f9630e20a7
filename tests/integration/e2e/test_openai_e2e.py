"""The official ``openai`` client against a real uvicorn API and Celery worker (PostgreSQL +
Redis): a user's OpenAI fine-tuning script with three lines changed trains a tiny model.

Upload, a supervised job to ``succeeded`` (events newest first, checkpoints with metrics, the
metrics CSV as a result file), a failed job's ``error``, pause and resume (the job continues
from its checkpoint with no gap in its steps) then cancel of the running job, a DPO job to ``succeeded`` with its reward metrics,
bad files and bodies answered in OpenAI's error shape, ``models.list``/``retrieve`` naming the
tuned jobs, and a ``method: reinforcement`` job (a prompts file, a ``string_check`` grader) to
``succeeded`` with each step's reward fields in its events. Evals: ``evals.create`` with a
``string_check`` and a ``python`` grader, runs on the base and on the first test's tuned model
(a job of kind ``eval`` each: ~6 s of CPU apiece for the trainer's start), hand-checked counts and
output items, and bad evals and runs answered naming the field or the line. One stack for the module.

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
from tests.fixtures.openai_e2e import sampler_greedy, wait_run
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
        pieces, sampler_text = sampler_greedy(oa_stack, session["id"], CHAT, 12)
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


EVAL_ITEMS = [{"question": "Is water wet?", "answer": "yes"}, {"question": "Is fire cold?", "answer": "no"},
              {"question": "Is the sky up?", "answer": "yes"}]
EVAL_CRITERIA = [
    # Hand-checkable on any output: no completion equals the reference, so "ne" passes every item.
    {"type": "string_check", "name": "not the marker", "input": "{{sample.output_text}}",
     "reference": "{{item.answer}}-never-said", "operation": "ne"},
    # Scores the item, not the output: the two "yes" items pass, the "no" item fails.
    {"type": "python", "name": "answer is yes", "pass_threshold": 1.0,
     "source": "def grade(sample, item):\n    return 1.0 if item['answer'] == 'yes' else 0.0\n"},
]
EVAL_TEMPLATE = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}


def _eval_source(data_source: dict[str, Any], model: str) -> dict[str, Any]:
    return {"type": "completions", "model": model, "input_messages": EVAL_TEMPLATE, "source": data_source,
            "sampling_params": {"max_completion_tokens": 3, "temperature": 0, "seed": 1}}


def test_an_eval_runs_on_the_base_and_on_the_tuned_model_with_hand_checked_scores(client, oa_stack, train_file):
    tuned_model = _tuned_model(client, oa_stack, train_file)  # the module's first job; a short one when run alone
    schema = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
              "required": ["question", "answer"]}
    ev = client.evals.create(name="yes or no", data_source_config={"type": "custom", "item_schema": schema},
                             testing_criteria=EVAL_CRITERIA, metadata={"team": "e2e"})
    assert ev.object == "eval" and ev.data_source_config.schema_["properties"]["item"] == schema
    assert [c.name for c in ev.testing_criteria] == ["not the marker", "answer is yes"]
    assert client.evals.retrieve(ev.id).name == "yes or no" and ev.id in [e.id for e in client.evals.list()]
    assert client.evals.update(ev.id, name="yes/no").name == "yes/no"

    items = "\n".join(json.dumps({"item": item}) for item in EVAL_ITEMS).encode()
    file_id = client.files.create(file=("items.jsonl", items), purpose="evals").id
    base = client.evals.runs.create(ev.id, name="base", data_source=_eval_source(
        {"type": "file_content", "content": [{"item": item} for item in EVAL_ITEMS]}, "tiny-llama"))
    ft = client.evals.runs.create(ev.id, name="tuned", data_source=_eval_source(
        {"type": "file_id", "id": file_id}, tuned_model))
    assert base.status == "queued" and ft.model == tuned_model
    for run in (base, ft):
        done = wait_run(client, ev.id, run.id, oa_stack)
        assert done.status == "completed", f"{done}\n{oa_stack.log_tail()}"
        assert (done.result_counts.total, done.result_counts.passed, done.result_counts.failed,
                done.result_counts.errored) == (3, 2, 1, 0)
        per = {r.testing_criteria: (r.passed, r.failed) for r in done.per_testing_criteria_results}
        assert per == {"not the marker": (3, 0), "answer is yes": (2, 1)}
        assert done.per_model_usage[0].invocation_count == 3
        items_out = list(client.evals.runs.output_items.list(run.id, eval_id=ev.id))
        assert [o.datasource_item for o in items_out] == EVAL_ITEMS
        assert [o.status for o in items_out] == ["pass", "fail", "pass"]
        assert [[(r.name, r.score, r.passed) for r in o.results] for o in items_out][1] == [
            ("not the marker", 1.0, True), ("answer is yes", 0.0, False)]
        assert items_out[0].sample.input[0].content == "Is water wet?"
        assert items_out[0].sample.usage.completion_tokens <= 3
        one = client.evals.runs.output_items.retrieve(items_out[2].id, eval_id=ev.id, run_id=run.id)
        assert one.datasource_item_id == 2
        failed = list(client.evals.runs.output_items.list(run.id, eval_id=ev.id, status="fail"))
        assert [o.datasource_item_id for o in failed] == [1]
    assert [r.id for r in client.evals.runs.list(ev.id)] == [base.id, ft.id]
    with oa_stack.client() as native:  # one store: the run is a job of kind eval
        job = native.get(f"/v1/jobs/{client.evals.runs.retrieve(base.id, eval_id=ev.id).model_extra['job_id']}").json()
        assert job["kind"] == "eval" and job["status"] == "succeeded"
    assert client.evals.runs.delete(base.id, eval_id=ev.id).deleted
    assert client.evals.delete(ev.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.evals.retrieve(ev.id)


def test_bad_evals_and_runs_answer_openai_errors_naming_the_field_or_line(client, oa_stack):
    def refused(call: Any, status: type[openai.APIStatusError]) -> dict[str, Any]:
        with pytest.raises(status) as caught:
            call()
        return caught.value.body

    config = {"type": "custom", "item_schema": {"type": "object", "properties": {"q": {"type": "string"}},
                                                "required": ["q"]}}
    body = refused(lambda: client.evals.create(data_source_config=config, testing_criteria=[
        {"type": "python", "name": "broken", "source": "def grade(sample, item) return 1"}]), openai.BadRequestError)
    assert body["param"] == "testing_criteria[0].source", body
    body = refused(lambda: client.evals.create(data_source_config=config, testing_criteria=[  # a judge not on the box
        {"type": "score_model", "name": "judge", "model": "no-such-model",
         "input": [{"role": "user", "content": "{{sample.output_text}}"}]}]), openai.BadRequestError)
    assert body["param"] == "testing_criteria[0].model" and "no-such-model" in body["message"], body
    before = {e.id for e in client.evals.list()}
    ev = client.evals.create(data_source_config=config, testing_criteria=[EVAL_CRITERIA[0]])
    assert {e.id for e in client.evals.list()} == before | {ev.id}, "the refused eval was not stored"
    content = [{"item": {"q": "a", "answer": "x"}}, {"item": {"q": 2, "answer": "y"}}]
    body = refused(lambda: client.evals.runs.create(ev.id, data_source=_eval_source(
        {"type": "file_content", "content": content}, "tiny-llama")), openai.BadRequestError)
    assert "line 2" in body["message"] and "item.q" in body["message"], body
    template = {"type": "template", "template": [{"role": "user", "content": "{{item.missing}}"}]}
    body = refused(lambda: client.evals.runs.create(ev.id, data_source={**_eval_source(
        {"type": "file_content", "content": content[:1]}, "tiny-llama"), "input_messages": template}),
        openai.BadRequestError)
    assert body["param"] == "data_source.input_messages.template[0].content" and "line 1" in body["message"], body
    body = refused(lambda: client.evals.runs.create(ev.id, data_source=_eval_source(
        {"type": "file_content", "content": content[:1]}, "ft:tiny-llama:someone:x:job-0123456789abcdef01234567")),
        openai.NotFoundError)
    assert body["param"] == "model", body
    refused(lambda: client.evals.runs.create("eval_unknown", data_source=_eval_source(
        {"type": "file_content", "content": content[:1]}, "tiny-llama")), openai.NotFoundError)
    assert list(client.evals.runs.list(ev.id)) == [], "no refused run was stored"
    client.evals.delete(ev.id)


def test_a_job_that_names_an_eval_runs_it_on_base_and_tuned_once_it_succeeded(client, oa_stack, train_file):
    """The worker's side of a spec's ``evals``: after ``succeeded`` it queues a base and a tuned run,
    which the same worker runs; ``/v1/jobs/{id}/evals`` compares them (the criteria score the item
    here, so both sides are hand-checkable: 3/3 and 2/3, no item changed)."""
    schema = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}}}
    ev = client.evals.create(name="after training", testing_criteria=EVAL_CRITERIA,
                             data_source_config={"type": "custom", "item_schema": schema})
    data_source = _eval_source({"type": "file_content", "content": [{"item": item} for item in EVAL_ITEMS]}, "")
    data_source.pop("model")
    with oa_stack.client() as native:
        job = native.post("/v1/jobs", json={"model": "tiny-llama", "training_file": train_file, "name": "with evals",
                                            "hyperparameters": {"max_steps": 1},
                                            "evals": [{"eval_id": ev.id, "data_source": data_source}]})
        assert job.status_code == 201, job.text
        assert wait(client, job.json()["id"], FINISHED, oa_stack).status == "succeeded"
        deadline = time.monotonic() + 120
        while True:
            [compared] = native.get(f"/v1/jobs/{job.json()['id']}/evals").json()["data"]
            sides = [compared[s] and compared[s]["status"] for s in ("base", "tuned")]
            if sides == ["completed", "completed"]:
                break
            assert time.monotonic() < deadline and "failed" not in sides, f"{sides}\n{oa_stack.log_tail()}"
            time.sleep(0.5)
    assert [(c["name"], c["base"], c["tuned"], c["difference"]) for c in compared["criteria"]] == [
        ("not the marker", 1.0, 1.0, 0.0), ("answer is yes", pytest.approx(2 / 3), pytest.approx(2 / 3), 0.0)]
    assert [row["changed"] for row in compared["items"]] == [False, False, False]
    assert compared["tuned"]["model"] == f"job:{job.json()['id']}" and compared["base"]["model"] == "tiny-llama"
