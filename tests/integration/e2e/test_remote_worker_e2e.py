"""A remote worker (FTQ_WORKER_KEY set) with its own empty data directory runs a tiny CPU job.

The API and the worker share only PostgreSQL and Redis, as two machines would: datasets come
down through ``/v1/worker/files``, checkpoints, job.json and the adapter go up through
``/v1/worker/jobs/.../artifacts``, and the user's API serves them from the API's own data
directory. A chat session, a generation job (on a checkpoint) and an eval run (on the tuned
model) of that job run on the same worker from the weights it downloads, and their lines reach
the API's store. Revoking the key stops the worker's claims.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.e2e_stacks import KEY_NAME
from tests.fixtures.stack_jobs import submit, upload, wait_job

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _tree_digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_remote_worker_trains_from_downloads_and_uploads_what_it_made(remote_stack, chat_dataset: Path):
    stack = remote_stack
    api_data, worker_data = stack.data_dir, stack.data_dir.parent / "worker-data"
    with stack.client() as client:
        file_id = upload(client, chat_dataset)
        sha = client.get(f"/v1/files/{file_id}").json()["sha256"]
        job = submit(client, file_id, checkpoint_every=10, name="remote")
        done = wait_job(client, job["id"], lambda j: j["status"] in ("succeeded", "failed", "cancelled"),
                        what="finished", timeout_s=300)
        assert done["status"] == "succeeded", f"{done}\n{stack.log_tail()}"
        checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        adapter_zip = client.get(f"/v1/jobs/{job['id']}/adapter")
    # The dataset came down into the worker's cache, by hash; the worker never saw the API's files/.
    assert (worker_data / "cache" / "files" / sha).read_bytes() == chat_dataset.read_bytes()
    assert not (worker_data / "files").exists()
    # Every recorded checkpoint, job.json and the adapter went up, byte for byte.
    api_job, worker_job = api_data / "jobs" / job["id"], worker_data / "jobs" / job["id"]
    steps = sorted(c["step"] for c in checkpoints)
    assert steps and steps[0] == 10, checkpoints
    for step in steps:
        name = f"step-{step:06d}"
        assert _tree_digests(api_job / "checkpoints" / name) == _tree_digests(worker_job / "checkpoints" / name)
    assert (api_job / "job.json").read_bytes() == (worker_job / "job.json").read_bytes()
    assert _tree_digests(api_job / "adapter") == _tree_digests(worker_job / "adapter")
    assert "adapter_model.safetensors" in _tree_digests(api_job / "adapter")
    # The user's API serves the adapter from its own store.
    assert adapter_zip.status_code == 200, adapter_zip.text
    with zipfile.ZipFile(io.BytesIO(adapter_zip.content)) as archive:
        served = archive.read("adapter_model.safetensors")
    assert served == (worker_job / "adapter" / "adapter_model.safetensors").read_bytes()


def _finished(client, job_id: str, stack, timeout_s: float = 180) -> dict:
    done = wait_job(client, job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled"), what="finished",
                    timeout_s=timeout_s)
    assert done["status"] == "succeeded", f"{done}\n{stack.log_tail()}"
    return done


def test_a_session_a_generation_job_and_an_eval_run_load_the_remote_jobs_weights(remote_stack, tmp_path: Path):
    """The first test's job (trained on this worker): the worker downloads its adapter and its
    step-10 checkpoint with its key, and uploads the generation's and the eval's lines."""
    stack = remote_stack
    api_data, worker_data = stack.data_dir, stack.data_dir.parent / "worker-data"
    with stack.client() as client:
        [trained] = [j["id"] for j in client.get("/v1/jobs").json()["data"]
                     if j["name"] == "remote" and j["status"] == "succeeded"]
        model = client.get(f"/openai/v1/fine_tuning/jobs/{trained}").json()["fine_tuned_model"]
        chat = client.post("/openai/v1/chat/completions", timeout=180, json={
            "model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, f"{chat.text}\n{stack.log_tail()}"
        assert chat.json()["usage"]["completion_tokens"] > 0
        [session] = client.get("/v1/sessions").json()["data"]
        assert session["worker_id"] == stack.worker_id and session["models"] == [f"job:{trained}"]
        assert client.delete(f"/v1/sessions/{session['id']}").status_code == 202
        deadline = time.monotonic() + 60
        while client.get(f"/v1/sessions/{session['id']}").json()["status"] == "running":
            assert time.monotonic() < deadline, stack.log_tail()
            time.sleep(0.2)

        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(3)))
        with prompts.open("rb") as f:
            file_id = client.post("/v1/files", files={"file": (prompts.name, f, "application/jsonl")},
                                  data={"purpose": "generate"}).json()["id"]
        gen = client.post("/v1/jobs", json={"kind": "generate", "model": f"job:{trained}@10", "prompts_file": file_id,
                                            "chunk_prompts": 1, "sampling": {"max_tokens": 3, "temperature": 0}})
        assert gen.status_code == 201, gen.text
        gen_done = _finished(client, gen.json()["id"], stack)
        lines = client.get(f"/v1/jobs/{gen_done['id']}/completions").text
        assert [json.loads(line)["index"] for line in lines.splitlines()] == [0, 1, 2]
        assert lines.encode() == (worker_data / "jobs" / gen_done["id"] / "completions.jsonl").read_bytes()
        assert (api_data / "jobs" / gen_done["id"] / "completions.jsonl").read_text() == lines
        assert (worker_data / "cache" / "artifacts" / trained / "checkpoints" / "step-000010").is_dir()

        ev = client.post("/v1/evals", json={"name": "remote", "data_source_config": {
            "type": "custom", "item_schema": {"type": "object", "required": ["q"]}}, "testing_criteria": [
            {"type": "string_check", "name": "not the marker", "input": "{{sample.output_text}}",
             "reference": "never-said", "operation": "ne"}]})
        assert ev.status_code in (200, 201), ev.text
        run = client.post(f"/v1/evals/{ev.json()['id']}/runs", json={"name": "tuned", "data_source": {
            "type": "completions", "model": model, "source": {"type": "file_content", "content": [
                {"item": {"q": "Is water wet?"}}, {"item": {"q": "Is fire cold?"}}]},
            "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.q}}"}]},
            "sampling_params": {"max_completion_tokens": 3, "temperature": 0}}})
        assert run.status_code in (200, 201), run.text
        run_done = _finished(client, run.json()["job_id"], stack)  # graded on the worker (the stack's only one)
        assert (worker_data / "jobs" / run_done["id"] / "completions.jsonl").is_file()
        shown = client.get(f"/v1/evals/{ev.json()['id']}/runs/{run.json()['id']}").json()
        assert shown["status"] == "completed" and shown["result_counts"]["passed"] == 2, shown
        assert (worker_data / "cache" / "artifacts" / trained / "adapter" / "adapter_config.json").is_file()


def test_the_worker_row_names_its_key_and_no_loopback_address(remote_stack):
    import psycopg

    url = remote_stack.env["FTQ_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT k.name, w.address FROM worker w JOIN worker_key k ON k.worker_key_id = w.key_id "
            "WHERE w.worker_id = %s", (remote_stack.worker_id,)).fetchone()
    assert row is not None and row[0] == KEY_NAME
    assert row[1] is None  # the route to the store's host is the loopback here: no address other machines could use


def test_a_revoked_key_claims_nothing(remote_stack, chat_dataset: Path):
    stack = remote_stack
    with stack.client() as client:
        assert client.delete(f"/v1/workers/keys/{KEY_NAME}").status_code == 200
        job = submit(client, upload(client, chat_dataset), name="after-revoke")
        log = stack.logs["worker"]
        deadline = time.monotonic() + 120
        while "claims nothing and stops beating: its FTQ_WORKER_KEY is revoked" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, f"the worker never refused to claim\n{stack.log_tail()}"
            time.sleep(0.3)
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
        client.post(f"/v1/jobs/{job['id']}/cancel")
