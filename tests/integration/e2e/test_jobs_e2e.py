"""A job submitted over HTTP trains a real tiny model, on both stores, through real processes."""

from __future__ import annotations

import io
import json
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.jobs.schemas import DecisionOut, PlanOut
from tests.fixtures.stack_jobs import SHORT, follow, submit, upload, wait_job
from trainer.events import STEP_FIELDS
from trainer.objectives.declarations import DPO_STEP_FIELDS

pytestmark = pytest.mark.integration

GPU_FIELDS = ("gpu_mem_allocated", "gpu_mem_reserved", "gpu_mem_peak")
LONG = {**SHORT, "max_steps": 100_000}
postgres_only = pytest.mark.parametrize("stack", ["postgres"], indirect=True)
"""For a test whose store side runs on both stores elsewhere (its docstring says where): CI is
CPU-bound, and each of these trains a job of its own (a trainer process importing torch, peft and
transformers). The PostgreSQL stack is the production one: API and worker apart, Redis between."""


@pytest.fixture(scope="module")
def trained(stack, chat_dataset: Path) -> tuple[str, list[tuple[int, str, dict[str, Any]]]]:
    """The stack's one successful SFT job (``SHORT``: 30 steps, a checkpoint every 10), trained once
    and followed over SSE: its id and events. The success test checks the run; the export test
    exports the same job instead of training one of its own (a trainer start, ~9 s of CPU)."""
    with stack.client() as client:
        job = submit(client, upload(client, chat_dataset), checkpoint_every=10, name="e2e")
        assert job["status"] == "queued"
        return job["id"], follow(client, job["id"])


# peft 0.21 still reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_job_trains_to_success_and_its_adapter_loads(stack, trained, tmp_path: Path):
    job_id, events = trained
    with stack.client() as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", f"{job}\n{stack.log_tail()}"
        ids = [seq for seq, _, _ in events]
        assert ids == list(range(1, len(ids) + 1)), "event ids must increase by one, from 1"
        states = [data["status"] for _, kind, data in events if kind == "state"]
        assert states == ["queued", "running", "succeeded"]
        kinds = {kind for _, kind, _ in events}
        assert {"plan", "step", "checkpoint", "state"} <= kinds
        steps = [data for _, kind, data in events if kind == "step"]
        assert [s["step"] for s in steps] == list(range(1, 31))
        losses = [s["loss"] for s in steps]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, f"loss did not fall: {losses}"
        assert job["progress"] == {"step": 30, "total_steps": 30}
        assert job["plan"]["hardware"]["device"] == "cpu"
        # The real trainer's events keep the contracts: the plan fits the API's schema with nothing
        # dropped, a step carries exactly the StepEvent fields (and the event's time).
        [plan] = [data for _, kind, data in events if kind == "plan"]
        assert PlanOut.model_validate(plan) and set(plan) <= set(PlanOut.model_fields)
        assert all(set(d) == set(DecisionOut.model_fields) for d in plan["decisions"])
        assert all(set(s) == set(STEP_FIELDS) | {"time"} for s in steps)

        # A reconnecting viewer gets exactly what it missed.
        middle = ids[len(ids) // 2]
        assert follow(client, job["id"], last_event_id=middle) == [e for e in events if e[0] > middle]

        rows = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 100}).json()["data"]
        assert [r["step"] for r in rows] == list(range(1, 31))
        for row in rows:
            missing = set(STEP_FIELDS) - {"total_steps"} - set(row)
            assert not missing, f"metric row lacks {missing}"
            assert all(row[f] is None for f in GPU_FIELDS), "GPU memory must be null on CPU"
            assert row["mfu"] is None
            for name in ("loss", "lr", "grad_norm", "tokens", "sequences", "step_ms", "data_ms", "forward_ms",
                         "backward_ms", "optimizer_ms", "tokens_per_s", "host_rss", "time"):
                assert row[name] is not None, f"step {row['step']}: {name} is null"
        later = client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": 25}).json()["data"]
        assert [r["step"] for r in later] == [26, 27, 28, 29, 30]

        checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert [c["step"] for c in checkpoints] == [10, 20, 30] and checkpoints[-1]["final"]

        archive = client.get(f"/v1/jobs/{job['id']}/adapter")
        assert archive.status_code == 200, archive.text
    adapter_dir = tmp_path / "adapter"
    zipfile.ZipFile(io.BytesIO(archive.content)).extractall(adapter_dir)
    _assert_adapter_loads(stack.model_root / stack.model, adapter_dir)


def _assert_adapter_loads(base_dir: Path, adapter_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (adapter_dir / "adapter_config.json").is_file()
    assert (adapter_dir / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = PeftModel.from_pretrained(base, adapter_dir)
    lora = [name for name, _ in model.named_parameters() if "lora_" in name]
    assert lora, "the adapter added no LoRA weights"
    trained = [p for name, p in model.named_parameters() if "lora_B" in name]
    assert any(torch.count_nonzero(p) > 0 for p in trained), "lora_B is all zeros: the adapter was not trained"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 6, 7]])).logits
    assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()


def test_cancel_a_queued_job_and_a_running_one(stack, chat_dataset: Path):
    with stack.client() as client:
        file_id = upload(client, chat_dataset)
        running = submit(client, file_id, hyperparameters=LONG, checkpoint_every=0)
        waiting = submit(client, file_id, hyperparameters=SHORT)  # one worker: it waits behind `running`

        cancelled = client.post(f"/v1/jobs/{waiting['id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"

        wait_job(client, running["id"], lambda j: j["status"] == "running" and j["progress"]["step"] >= 3,
                 what="running with steps")
        response = client.post(f"/v1/jobs/{running['id']}/cancel")
        assert response.status_code == 202, response.text

        events = follow(client, running["id"])
        final = events[-1][2]
        assert final["status"] == "cancelled", f"{final}\n{stack.log_tail()}"
        job = client.get(f"/v1/jobs/{running['id']}").json()
        assert job["status"] == "cancelled" and job["error"] is None
        checkpoints = client.get(f"/v1/jobs/{running['id']}/checkpoints").json()["data"]
        assert checkpoints, "a cancelled run must leave a checkpoint to resume from"
        assert checkpoints[-1]["step"] >= 3

        # The job cancelled while queued never reached a worker.
        assert client.get(f"/v1/jobs/{waiting['id']}").json()["started_at"] is None
        assert not (stack.data_dir / "jobs" / waiting["id"] / "job.json").exists()


@postgres_only
def test_a_crashing_trainer_fails_the_job_and_the_worker_takes_the_next(stack, chat_dataset: Path, tmp_path: Path):
    """PostgreSQL only: a failed job's task ends as a finished one does (worker/tasks.py), so the
    embedded broker's side is the success test's; the failure's store side on SQLite is
    tests/unit/worker (crash -> failed with the stderr tail), and the CLI with the key ``ftq up``
    saved is tests/integration/e2e/test_readme_quickstart.py."""
    with stack.client() as client:
        broken = submit(client, upload(client, chat_dataset), model=stack.corrupt_model)

        # The next job goes in through the CLI: it uploads the local dataset, submits, and
        # follows the stream (exit 0 only on success) while the broken job fails before it.
        job_file = tmp_path / "job.yaml"
        job_file.write_text(json.dumps({"model": stack.model, "training_file": str(chat_dataset),
                                        "hyperparameters": {**SHORT, "max_steps": 5}}))
        env = {**stack.env, "FTQ_API_URL": stack.url, "FTQ_API_KEY": stack.api_key}
        cli = subprocess.run([sys.executable, "-m", "cli", "submit", str(job_file), "--follow"],
                             env=env, capture_output=True, text=True, timeout=300)

        job = client.get(f"/v1/jobs/{broken['id']}").json()
        assert job["status"] == "failed", f"{job}\n{stack.log_tail()}"
        assert job["error"]["code"] and job["error"]["message"]
        message = job["error"]["message"].lower()
        assert "safetensors" in message or "header" in message, job["error"]
        assert follow(client, broken["id"])[-1][2]["status"] == "failed"

        assert cli.returncode == 0, f"{cli.stdout}\n{cli.stderr}\n{stack.log_tail()}"
        after_id, *lines = cli.stdout.splitlines()
        assert lines[0] == "state: queued" and lines[-1].startswith("state: succeeded")
        assert client.get(f"/v1/jobs/{after_id}").json()["status"] == "succeeded"


def test_only_the_first_ftq_up_makes_an_admin_and_prints_its_key_once(stack):
    from tests.fixtures.stack import KEY_PATTERN, printed_key

    if stack.name != "embedded":  # production: `ftq api` makes no user; `ftq users create` did
        listed = stack.ftq("users", "list")
        assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == ["e2e"], listed.stdout
        assert not KEY_PATTERN.search(stack.logs["api"].read_text())
        return
    log = stack.logs["up"].read_text()
    assert printed_key(log) == stack.api_key
    assert "shown once" in log and "ftq users create" in log
    config = Path(stack.env["FTQ_CONFIG"])
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    with stack.client() as client:
        me = client.get("/v1/users/me").json()
    assert (me["name"], me["is_admin"]) == ("admin", True)


@postgres_only
def test_team_keys_and_ownership_through_the_cli(stack, chat_dataset: Path, tmp_path: Path):
    """``ftq users create`` prints a working key once; owners and admins act, others get 403.
    PostgreSQL only: the client commands speak HTTP alone; ``ftq users create|revoke`` on SQLite is
    tests/unit/cli/test_cli_users.py, the 403s on both stores tests/integration/test_api_auth.py."""
    alice, bob = stack.create_user("alice", "--max-running", "2"), stack.create_user("bob")
    listed = stack.ftq("users", "list")
    assert listed.returncode == 0 and "alice" in listed.stdout and alice not in listed.stdout
    with stack.client(headers={"Authorization": f"Bearer {alice}"}) as as_alice, \
            stack.client(headers={"Authorization": f"Bearer {bob}"}) as as_bob:
        job = submit(as_alice, upload(as_alice, chat_dataset), hyperparameters=LONG)
        assert job["owner"] == "alice"
        assert job["id"] in [j["id"] for j in as_bob.get("/v1/jobs").json()["data"]]
        refused = as_bob.post(f"/v1/jobs/{job['id']}/cancel")
        assert refused.status_code == 403 and "alice" in refused.json()["error"]["message"]

        # bob logs in with the CLI: the key goes to a 0600 config file the client commands read
        config = tmp_path / "bob.toml"
        env_config = {"FTQ_CONFIG": str(config)}
        stack.env, saved = {**stack.env, **env_config}, stack.env
        try:
            login = stack.ftq("login", "--key", bob, "--url", stack.url)
            assert login.returncode == 0, login.stderr
            assert stat.S_IMODE(config.stat().st_mode) == 0o600
            mine = stack.ftq("jobs")
            assert mine.returncode == 0 and job["id"] in mine.stdout
            cancel = stack.ftq("cancel", job["id"])
            assert cancel.returncode == 2 and "403" in cancel.stderr
        finally:
            stack.env = saved

        assert as_alice.post(f"/v1/jobs/{job['id']}/cancel").status_code in (200, 202)
        revoke = stack.ftq("users", "revoke", bob.split("_")[1])
        assert revoke.returncode == 0, revoke.stderr
        assert as_bob.get("/v1/jobs").status_code == 401
        wait_job(as_alice, job["id"], lambda j: j["status"] == "cancelled", what="cancelled")


@postgres_only
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_finished_job_exports_a_portable_adapter_a_merged_model_and_a_gguf(stack, trained, tmp_path: Path):
    """The adapter zip loads in a fresh process that knows only the base's name; the merged export
    and the GGUF (in llama.cpp) give the adapter's greedy tokens; the CLI downloads the GGUF.
    The job is the success test's (``trained``). PostgreSQL only: the export's store side runs on
    both stores in tests/integration/test_api_exports.py."""
    from tests.fixtures.exports import fresh_process_greedy, llama_cpp_greedy, wait_export

    with stack.client() as client:
        job = client.get(f"/v1/jobs/{trained[0]}").json()
        assert job["status"] == "succeeded", f"{job}\n{stack.log_tail()}"
        asked = client.post(f"/v1/jobs/{job['id']}/exports", json={"format": "merged"})
        assert asked.status_code == 202, asked.text
        adapter = client.get(f"/v1/jobs/{job['id']}/adapter")
        merged = wait_export(client, job["id"], asked.json()["id"])
        assert merged["status"] == "succeeded", f"{merged}\n{stack.log_tail()}"
        merged_zip = client.get(merged["download_url"])
        # The stream ends at the job's final state; resumed after it, it replays the export events.
        final = follow(client, job["id"])[-1][0]
        events = [data for _, kind, data in follow(client, job["id"], last_event_id=final) if kind == "export"]
    assert {e["stage"] for e in events} >= {"load", "merge", "save"}, events
    zipfile.ZipFile(io.BytesIO(adapter.content)).extractall(tmp_path / "adapter")
    zipfile.ZipFile(io.BytesIO(merged_zip.content)).extractall(tmp_path / "merged")
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert f"base_model: {stack.model}" in card and "sha256" in card and "Final train loss" in card

    env = {**stack.env, "FTQ_API_URL": stack.url, "FTQ_API_KEY": stack.api_key}
    gguf = tmp_path / "model.gguf"
    cli = subprocess.run([sys.executable, "-m", "cli", "export", job["id"], "--format", "gguf", "--quantization", "f32",
                          "-o", str(gguf)], env=env, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0 and gguf.read_bytes()[:4] == b"GGUF", f"{cli.stderr[-2000:]}\n{stack.log_tail()}"

    fresh = fresh_process_greedy(stack.model_root, tmp_path / "adapter", tmp_path / "merged")
    assert fresh["base"] == stack.model, "the adapter must name its base portably, not by a server path"
    assert fresh["chat_template"], "the zip carries the chat template the job trained with"
    assert fresh["merged"] == fresh["adapter"]
    assert llama_cpp_greedy(gguf, fresh["ids"]) == fresh["adapter"]


def _preference_dataset(path: Path) -> Path:
    """24 OpenAI DPO records: a short right answer preferred to a long refusal."""
    with path.open("w") as f:
        for i in range(24):
            f.write(json.dumps({
                "input": {"messages": [{"role": "user", "content": f"What is {i % 5} plus one?"}]},
                "preferred_output": [{"role": "assistant", "content": f"The answer is {i % 5 + 1}."}],
                "non_preferred_output": [{"role": "assistant", "content": "I do not know, sorry about that."}],
            }) + "\n")
    return path


# peft 0.21 still reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a model.
@postgres_only
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_dpo_job_trains_to_success_with_its_reward_metrics(stack, tmp_path: Path):
    """PostgreSQL only: the path is the SFT job's; SQLite's DPO columns: tests/integration/test_api_jobs_dpo.py."""
    with stack.client() as client:
        file_id = upload(client, _preference_dataset(tmp_path / "pairs.jsonl"))
        assert client.get(f"/v1/files/{file_id}").json()["format"] == "preference"
        refused = client.post("/v1/jobs", json={"model": "tiny-llama", "training_file": file_id, "hyperparameters": SHORT})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "training_file", refused.text
        assert "objective" in refused.json()["error"]["message"]

        job = submit(client, file_id, objective="dpo", dpo={"beta": 0.1},
                     hyperparameters={**SHORT, "max_steps": 8, "learning_rate": 0.005})
        assert (job["spec"]["objective"], job["spec"]["dpo"]) == ("dpo", {"beta": 0.1, "label_smoothing": 0.0})
        events = follow(client, job["id"])
        job = client.get(f"/v1/jobs/{job['id']}").json()
        assert job["status"] == "succeeded", f"{job}\n{stack.log_tail()}"
        steps = [data for _, kind, data in events if kind == "step"]
        rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [r["step"] for r in rows] == [s["step"] for s in steps] == list(range(1, 9))
    for row in rows:
        assert all(row[f] is not None for f in DPO_STEP_FIELDS), row
        assert 0.0 <= row["reward_accuracy"] <= 1.0 and row["chosen_logp"] < 0 and row["rejected_logp"] < 0
    assert rows[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # a new adapter: the policy is the reference
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["reward_margin"] > rows[0]["reward_margin"]
    assert rows[-1]["reward_accuracy"] == 1.0


def _upload_records(client: httpx.Client, records: list[dict[str, Any]], purpose: str = "train") -> str:
    content = "".join(json.dumps(r) + "\n" for r in records)
    response = client.post("/v1/files", files={"file": ("d.jsonl", content)}, data={"purpose": purpose})
    assert response.status_code == 201, response.text
    return response.json()["id"]


@postgres_only
def test_preflight_refuses_an_all_masked_set_and_a_non_finite_job_fails_keeping_its_checkpoint(stack):
    """Issue 14's guards through the real service: an all-masked dataset is a 422 at the door; a
    model whose embeddings turn some records' loss NaN (tests/poison.py) skips those steps, fails
    ``non_finite`` at max_non_finite_steps naming the first, keeps its checkpoints (the newest holds
    the last good weights), and its eval rows and greedy samples were stored on the way.
    PostgreSQL only: the guards are the trainer's; on both stores, the 422 is
    tests/integration/test_api_jobs_preflight.py and the skip, eval and sample rows and the summary
    its ``TestResults``."""
    from tests.fixtures.stack import POISONED_MODEL
    from tests.poison import records, seed_with_order

    with stack.client() as client:
        masked = _upload_records(client, [{"prompt": "the cat sat on the mat " * 12, "completion": "yes"}] * 4)
        refused = client.post("/v1/jobs", json={"model": stack.model, "training_file": masked,
                                                "hyperparameters": {**SHORT, "max_seq_len": 16}})
        assert refused.status_code == 422, refused.text
        assert "cut before its first trainable token" in refused.json()["error"]["message"]

        train = _upload_records(client, records("ccppcc"))
        validation = _upload_records(client, records("cc"), purpose="validation")
        job = submit(client, train, model=POISONED_MODEL, validation_file=validation, checkpoint_every=1,
                     max_non_finite_steps=2, sample_prompts=["the cat"], sample_max_new_tokens=4,
                     hyperparameters={"max_steps": 6, "batch_tokens": 64, "max_seq_len": 64,
                                      "learning_rate": 0.01, "seed": seed_with_order("ccppcc", "ccpp", 64)})
        events = follow(client, job["id"])
        job = client.get(f"/v1/jobs/{job['id']}").json()
        assert job["status"] == "failed" and job["error"]["code"] == "non_finite", f"{job}\n{stack.log_tail()}"
        assert job["error"]["message"].startswith("step 3: "), job["error"]
        skips = [data for _, kind, data in events if kind == "skip"]
        assert [(s["step"], s["consecutive"]) for s in skips] == [(3, 1), (4, 2)]
        checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert [c["step"] for c in checkpoints] == [1, 2, 3]
        assert client.get(f"/v1/jobs/{job['id']}/checkpoints/3/download").status_code == 200
        evals = client.get(f"/v1/jobs/{job['id']}/metrics").json()["eval"]
        assert [e["step"] for e in evals] == [1, 2, 3] and all(e["loss"] > 0 for e in evals)
        samples = [data for _, kind, data in events if kind == "sample"]
        assert [s["step"] for s in samples] == [1, 2, 3] and samples[0]["samples"][0]["prompt"] == "the cat"
        summary = job["summary"]
        assert summary["skipped_steps"] == 2 and summary["steps"] == 4, summary
        assert summary["best_eval_loss"] == min(e["loss"] for e in evals)
