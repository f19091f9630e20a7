"""Generation jobs on a remote worker load whole models that came down through the API.

The stack is ``remote_stack`` (its own instance here): the API and a worker with a worker key and
an empty data directory of its own, sharing only PostgreSQL and Redis. Two tiny jobs train there,
a LoRA one (then exported ``merged``, on the same worker) and a ``method: full`` one. A generation
job on ``export:<id>`` and one on ``job:<full job>`` (its ``model/``, not an adapter), and a chat
session on the full job, then run on the worker, which downloads exactly those directories with
its key (``worker/remote_generation.py``, ``core/workers/access.py``). What proves the right weights were
loaded: the trainer's job.json names the downloaded directory as the model (no adapter), and that
directory holds the API's bytes, file for file; a generation on the tiny base answers otherwise.
Last, the full job's ``model/`` loses its tokenizer files, on the API and in the worker's cache (a full
job that finished before ``model/`` kept the tokenizer): generation and chat run on the base's
tokenizer, resolved on the worker's model root, and answer as before.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.exports import wait_export
from tests.fixtures.stack import MODEL, Stack
from tests.fixtures.stack_jobs import SHORT, finished, submit, tree_digests, upload, upload_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["Count to three:", "Name a colour:"]
SAMPLING = {"max_tokens": 4, "temperature": 0}
SAVED_BY_OLD_FULL_JOBS = {"config.json", "generation_config.json", "model.safetensors"}
"""What ``model.save_pretrained`` alone wrote: a full job's ``model/`` before it kept the tokenizer."""


@pytest.fixture(scope="module")
def trained(remote_stack: Stack, chat_dataset: Path) -> dict[str, str]:
    """``{"lora": id, "full": id}``: two tiny jobs that succeeded on the remote worker (submitted at
    once; the worker runs them one after the other)."""
    with remote_stack.client() as client:
        file_id = upload(client, chat_dataset)
        lora = submit(client, file_id, hyperparameters={**SHORT, "max_steps": 4}, name="lora")
        full = submit(client, file_id, method="full", name="full",
                      hyperparameters={**SHORT, "max_steps": 4, "learning_rate": 0.001})
        for job in (lora, full):
            finished(client, job["id"], remote_stack, timeout_s=300)
    return {"lora": lora["id"], "full": full["id"]}


@pytest.fixture(scope="module")
def prompts_file(remote_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> str:
    with remote_stack.client() as client:
        return upload_prompts(client, tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


def _generate(stack: Stack, client: httpx.Client, model: str, prompts: str) -> tuple[dict[str, Any], str]:
    """A generation job on ``model`` run to success; the job and its completions as served."""
    asked = client.post("/v1/jobs", json={"kind": "generate", "model": model, "prompts_file": prompts,
                                          "sampling": SAMPLING})
    assert asked.status_code == 201, asked.text
    done = finished(client, asked.json()["id"], stack)
    served = client.get(f"/v1/jobs/{done['id']}/completions")
    assert served.status_code == 200, served.text
    return done, served.text


def _check_ran_remotely(stack: Stack, gen_id: str, served: str) -> dict[str, Any]:
    """The served completions are the worker's, one line per prompt; the trainer's job.json."""
    api_data, worker_data = stack.data_dir, stack.data_dir.parent / "worker-data"
    assert [json.loads(line)["index"] for line in served.splitlines()] == list(range(len(PROMPTS)))
    assert served.encode() == (worker_data / "jobs" / gen_id / "completions.jsonl").read_bytes()
    assert (api_data / "jobs" / gen_id / "completions.jsonl").read_text() == served
    return json.loads((worker_data / "jobs" / gen_id / "job.json").read_text())


def _texts(served: str) -> list[list[str]]:
    return [[choice["text"] for choice in json.loads(line)["choices"]] for line in served.splitlines()]


def test_a_generation_job_on_a_merged_export_loads_the_apis_export(remote_stack, trained, prompts_file):
    stack, job_id = remote_stack, trained["lora"]
    with stack.client() as client:
        asked = client.post(f"/v1/jobs/{job_id}/exports", json={"format": "merged"})
        assert asked.status_code == 202, asked.text
        export = wait_export(client, job_id, asked.json()["id"])
        assert export["status"] == "succeeded", f"{export}\n{stack.log_tail()}"
        gen, served = _generate(stack, client, f"export:{export['id']}", prompts_file)
    config = _check_ran_remotely(stack, gen["id"], served)
    cached = stack.data_dir.parent / "worker-data" / "cache" / "artifacts" / job_id / "exports" / export["id"]
    assert config["model"] == str(cached) and config.get("adapter") is None, config
    in_api = tree_digests(stack.data_dir / "jobs" / job_id / "exports" / export["id"])
    assert "model.safetensors" in in_api and tree_digests(cached) == in_api


def test_a_generation_job_on_a_full_fine_tune_loads_its_model_dir(remote_stack, trained, prompts_file):
    stack, job_id = remote_stack, trained["full"]
    with stack.client() as client:
        gen, served = _generate(stack, client, f"job:{job_id}", prompts_file)
        _, on_base = _generate(stack, client, "tiny-llama", prompts_file)
    config = _check_ran_remotely(stack, gen["id"], served)
    cached = stack.data_dir.parent / "worker-data" / "cache" / "artifacts" / job_id / "model"
    assert config["model"] == str(cached) and config.get("adapter") is None, config
    in_api = tree_digests(stack.data_dir / "jobs" / job_id / "model")
    assert "model.safetensors" in in_api and tree_digests(cached) == in_api
    # The tuned weights, not the base's: greedy answers differ from the base's on the same prompts.
    assert _texts(served) != _texts(on_base), (served, on_base)


def _chat_once(stack: Stack, client: httpx.Client, job_id: str) -> dict[str, Any]:
    """A chat completion on ``job:<id>`` (a session the worker starts for it), then the session ended."""
    model = client.get(f"/openai/v1/fine_tuning/jobs/{job_id}").json()["fine_tuned_model"]
    chat = client.post("/openai/v1/chat/completions", timeout=180, json={
        "model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, f"{chat.text}\n{stack.log_tail()}"
    assert chat.json()["usage"]["completion_tokens"] > 0
    [session] = [s for s in client.get("/v1/sessions").json()["data"] if s["status"] == "running"]
    assert session["worker_id"] == stack.worker_id and session["models"] == [f"job:{job_id}"], session
    assert client.delete(f"/v1/sessions/{session['id']}").status_code == 202
    deadline = time.monotonic() + 60
    while client.get(f"/v1/sessions/{session['id']}").json()["status"] == "running":
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    return chat.json()


def test_a_chat_session_on_a_full_fine_tune_loads_its_model_dir(remote_stack, trained):
    """A session loads ``job:<id>`` as a generation job does (``model/`` with its tokenizer, downloaded)."""
    stack, job_id = remote_stack, trained["full"]
    with stack.client() as client:
        _chat_once(stack, client, job_id)
    cached = stack.data_dir.parent / "worker-data" / "cache" / "artifacts" / job_id / "model"
    assert "tokenizer.json" in tree_digests(cached)


def test_a_full_fine_tune_saved_without_its_tokenizer_runs_on_its_bases(remote_stack, trained, prompts_file):
    """Generation and chat on a full job whose ``model/`` has no tokenizer files (on the API and in the
    worker's cache) answer as with them: the worker loads its base's tokenizer from its own model root."""
    stack, job_id = remote_stack, trained["full"]
    cached = stack.data_dir.parent / "worker-data" / "cache" / "artifacts" / job_id / "model"
    with stack.client() as client:
        _, before = _generate(stack, client, f"job:{job_id}", prompts_file)
        chat_before = _chat_once(stack, client, job_id)
        for directory in (stack.data_dir / "jobs" / job_id / "model", cached):
            for path in directory.iterdir():
                if path.name not in SAVED_BY_OLD_FULL_JOBS:
                    path.unlink()
            assert {p.name for p in directory.iterdir()} == SAVED_BY_OLD_FULL_JOBS
        gen, after = _generate(stack, client, f"job:{job_id}", prompts_file)
        chat_after = _chat_once(stack, client, job_id)
    config = _check_ran_remotely(stack, gen["id"], served=after)
    assert config["model"] == str(cached) and config["tokenizer"] == str((stack.model_root / MODEL).resolve())
    assert _texts(after) == _texts(before), (after, before)
    assert chat_after["choices"][0]["message"] == chat_before["choices"][0]["message"]
    assert "tokenizer.json" not in tree_digests(cached)
