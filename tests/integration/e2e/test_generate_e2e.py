"""Batch generation jobs end to end over HTTP, on CPU: one stack (PostgreSQL, Redis, ``ftq api``,
``ftq worker --slots 3``) for every assertion here. Bad input is refused naming the field and stores
nothing; a job is submitted, followed, cancelled after its first prompts, resumed under its own id
(it continues at the first undone prompt: every prompt has exactly one line), previewed and
downloaded; a job of ``gpus: 2`` splits its prompts over two torchrun ranks. An lm-eval task (a local YAML
and JSONL, ``ftq eval lm-eval``) runs as an eval run on the same worker (its trainer is generation's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.fixtures.stack import MODEL
from tests.fixtures.stack_jobs import follow, wait_job

pytestmark = pytest.mark.integration

PROMPTS = 48
"""One prompt a chunk: the cancel must land while chunks are left. 16 prompts (~4 s here) finished
before a cancel sent at the second chunk took effect once (the job ended succeeded)."""


def _upload(client, path: Path) -> tuple[int, dict]:
    with path.open("rb") as f:
        response = client.post("/v1/files", files={"file": (path.name, f, "application/jsonl")},
                               data={"purpose": "generate"})
    return response.status_code, response.json()


def _prompts(path: Path, count: int) -> Path:
    lines = [{"prompt": f"Count to {i}:"} if i % 2 else {"messages": [{"role": "user", "content": f"Say {i}."}]}
             for i in range(count)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _submit(client, file_id: str, **fields) -> dict:
    body = {"kind": "generate", "model": MODEL, "prompts_file": file_id, **fields}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def _lines(client, job_id: str) -> list[dict]:
    response = client.get(f"/v1/jobs/{job_id}/completions")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored(pool_stack, tmp_path: Path):
    with pool_stack.client() as client:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "fine"}\n{"messages": [{"role": "robot", "content": "x"}]}\n')
        status, body = _upload(client, bad)
        assert status == 422 and body["error"]["line"] == 2 and "messages[0].role" in body["error"]["message"]
        assert client.get("/v1/files", params={"purpose": "generate"}).json()["data"] == []
        _, uploaded = _upload(client, _prompts(tmp_path / "p.jsonl", 2))
        refusals = [
            ({"sampling": {"top_p": 0}}, 422, "sampling.top_p"),
            ({"sampling": {"logprobs": False, "top_logprobs": 3}}, 422, "sampling.top_logprobs"),
            ({"sampling": {"beam_width": 2}}, 422, "sampling.beam_width"),
            ({"model": "job:job-" + "0" * 24}, 422, "model"),
            ({"prompts_file": "file-" + "0" * 24}, 422, "prompts_file"),
        ]
        for fields, code, param in refusals:
            response = client.post("/v1/jobs", json={"kind": "generate", "model": MODEL,
                                                     "prompts_file": uploaded["id"], **fields})
            assert (response.status_code, response.json()["error"]["param"]) == (code, param), response.text
        assert client.get("/v1/jobs").json()["data"] == []


def test_submit_progress_cancel_resume_preview_and_download(pool_stack, tmp_path: Path):
    stack = pool_stack
    with stack.client() as client:
        _, uploaded = _upload(client, _prompts(tmp_path / "prompts.jsonl", PROMPTS))
        assert uploaded["format"] == "prompts" and uploaded["num_records"] == PROMPTS
        sampling = {"max_tokens": 48, "ignore_eos": True, "temperature": 1.0, "seed": 5, "logprobs": True}
        job = _submit(client, uploaded["id"], name="gen", sampling=sampling, chunk_prompts=1)
        assert (job["kind"], job["training_file"]) == ("generate", uploaded["id"])
        running = wait_job(client, job["id"], lambda j: (j["generation"] or {}).get("prompts_done", 0) >= 2,
                           what="generating")
        assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
        stopped = wait_job(client, job["id"], lambda j: j["status"] in ("cancelled", "succeeded"), what="stopped")
        assert stopped["status"] == "cancelled", f"{stopped}\n{stack.log_tail()}"
        done_at_cancel = stopped["generation"]["prompts_done"]
        assert 2 <= done_at_cancel < PROMPTS, running
        assert client.get(f"/v1/jobs/{job['id']}/completions").status_code == 409
        early = client.get(f"/v1/jobs/{job['id']}/completions/preview", params={"limit": 2}).json()["data"]
        assert [line["index"] for line in early] == [0, 1]

        resumed = client.post(f"/v1/jobs/{job['id']}/resume")
        assert resumed.status_code == 201 and resumed.json()["id"] == job["id"], resumed.text
        events = follow(client, job["id"], timeout_s=300)
        finished = client.get(f"/v1/jobs/{job['id']}").json()
        assert finished["status"] == "succeeded", f"{finished}\n{stack.log_tail()}"
        assert finished["generation"]["prompts_done"] == PROMPTS and finished["generation"]["tokens_per_s"] > 0
        progress = [data for _, kind, data in events if kind == "progress"]
        resume_at = [p["prompts_done"] for p in progress if p["tokens_per_s"] is None]
        assert resume_at == [0, done_at_cancel]  # the first attempt's start, then the resume point

        lines = _lines(client, job["id"])
        assert [line["index"] for line in lines] == list(range(PROMPTS))  # each prompt once, in order
        assert all(len(line["choices"][0]["logprobs"]) == 48 for line in lines)
        preview = client.get(f"/v1/jobs/{job['id']}/completions/preview", params={"limit": 3}).json()["data"]
        assert preview == lines[:3] and early == lines[:2]
        # not a fine-tuning job: OpenAI's fine-tuning routes neither list nor show it
        assert client.get(f"/openai/v1/fine_tuning/jobs/{job['id']}").status_code == 404
        listed = client.get("/openai/v1/fine_tuning/jobs").json()["data"]
        assert job["id"] not in [j["id"] for j in listed]


def test_two_gpus_split_the_prompts_over_two_ranks(pool_stack, tmp_path: Path):
    with pool_stack.client() as client:
        _, uploaded = _upload(client, _prompts(tmp_path / "four.jsonl", 4))
        job = _submit(client, uploaded["id"], gpus=2, sampling={"max_tokens": 4, "temperature": 0.0})
        events = follow(client, job["id"], timeout_s=300)
        finished = client.get(f"/v1/jobs/{job['id']}").json()
        assert finished["status"] == "succeeded", f"{finished}\n{pool_stack.log_tail()}"
        assert any("on 2 rank(s)" in data.get("message", "") for _, kind, data in events if kind == "log")
        assert [line["index"] for line in _lines(client, job["id"])] == [0, 1, 2, 3]


def test_ftq_generate_submits_follows_and_downloads(pool_stack, tmp_path: Path):
    stack = pool_stack
    assert stack.ftq("login", "--key", stack.api_key, "--url", stack.url).returncode == 0
    prompts, out = _prompts(tmp_path / "cli.jsonl", 3), tmp_path / "out.jsonl"
    done = stack.ftq("generate", MODEL, str(prompts), "--max-tokens", "4", "--temperature", "0", "-o", str(out),
                     timeout_s=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{stack.log_tail()}"
    job_id, written = done.stdout.split()
    assert written == str(out) and "progress: 3/3 prompts" in done.stderr
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1, 2]
    head = stack.ftq("completions", job_id, "--head", "1")
    assert head.returncode == 0 and json.loads(head.stdout) == json.loads(out.read_text().splitlines()[0])


LM_TASKS = Path(__file__).resolve().parents[2] / "data" / "lm_eval"


def test_an_lm_eval_task_runs_as_an_eval_run_through_ftq_eval_lm_eval(pool_stack, tmp_path: Path):
    """tests/data/lm_eval's multiple-choice task, its YAML naming its JSONL beside it: the CLI uploads the
    documents, the worker scores each choice with forwards (lm-eval's own acc), and the run reads as any
    eval run: counts, the metric's pass rate, output items with the rendered context and the likeliest choice."""
    stack = pool_stack
    pytest.importorskip("lm_eval", reason="the optional lm-eval extra is not installed")
    shutil.copy(LM_TASKS / "tiny_qa.jsonl", tmp_path / "qa.jsonl")
    task = (LM_TASKS / "ftq_tiny_choice.yaml").read_text().replace("tests/data/lm_eval/tiny_qa.jsonl", "qa.jsonl")
    (tmp_path / "choice.yaml").write_text(task)
    docs = [json.loads(line) for line in (tmp_path / "qa.jsonl").read_text().splitlines()]
    with stack.client() as client:
        ev = client.post("/v1/evals", json={"name": "tiny qa", "data_source_config": {
            "type": "custom", "item_schema": {"type": "object", "required": ["question", "choices", "label"]}},
            "testing_criteria": [{"type": "string_check", "name": "unused", "input": "{{sample.output_text}}",
                                  "reference": "x", "operation": "eq"}]}).json()
        assert stack.ftq("login", "--key", stack.api_key, "--url", stack.url).returncode == 0
        done = stack.ftq("eval", "lm-eval", ev["id"], MODEL, str(tmp_path / "choice.yaml"), timeout_s=300)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{stack.log_tail()}"
        run_id = done.stdout.split()[0]
        run = client.get(f"/v1/evals/{ev['id']}/runs/{run_id}").json()
        assert run["status"] == "completed" and run["data_source"]["type"] == "lm_eval", run
        items = client.get(f"/v1/evals/{ev['id']}/runs/{run_id}/output_items", params={"limit": 10}).json()["data"]
        assert [i["datasource_item"] for i in items] == docs
        right = 0
        for item, doc in zip(items, docs):
            answer = item["sample"]["output"][0]["content"]
            assert item["sample"]["input"] == [{"role": "user", "content": f"Q: {doc['question']}\nA:"}]
            assert answer.strip() in doc["choices"]
            correct = answer == " " + doc["choices"][doc["label"]]  # acc: the likeliest choice is the label
            assert [(r["name"], r["score"]) for r in item["results"]] == [("acc", float(correct))]
            assert item["status"] == ("pass" if correct else "fail")
            right += correct
        assert run["result_counts"] == {"total": 4, "passed": right, "failed": 4 - right, "errored": 0}
        [acc] = run["per_testing_criteria_results"]
        assert (acc["testing_criteria"], acc["pass_rate"]) == ("acc", right / 4)
        job = client.get(f"/v1/jobs/{run['job_id']}").json()
        assert (job["kind"], job["status"]) == ("eval", "succeeded")
    shown = stack.ftq("eval", "show", ev["id"])
    assert shown.returncode == 0 and run_id in shown.stdout and "acc: " in shown.stdout, shown.stdout
