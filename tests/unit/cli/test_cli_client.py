"""The client commands against the real API app (in process, SQLite store, no worker)."""

from __future__ import annotations

import io

import pytest

from cli.errors import CliError
from cli.jobs import describe, follow, format_jobs, gpus_cell, load_job_file, progress_line, submit

# The ``api`` and ``job_file`` fixtures are in conftest.py (the submit-priority tests use them too).


class TestSubmit:
    def test_uploads_a_local_dataset_then_creates_the_job(self, api, job_file):
        job = submit(api, load_job_file(job_file), base_dir=job_file.parent)
        assert job["status"] == "queued" and job["training_file"].startswith("file-")
        files = api.get("/v1/files").json()["data"]
        assert [f["filename"] for f in files] == ["train.jsonl"]

    def test_an_api_refusal_is_a_readable_error(self, api, job_file):
        body = {**load_job_file(job_file), "hyperparameters": {"max_steps": 0}}
        with pytest.raises(CliError, match=r"POST /v1/jobs → 422: .*max_steps"):
            submit(api, body, base_dir=job_file.parent)

    def test_a_missing_dataset_path_is_named(self, api, job_file):
        with pytest.raises(CliError, match="'nope.jsonl' is neither a file id nor a readable file"):
            submit(api, {"model": "tiny", "training_file": "nope.jsonl"}, base_dir=job_file.parent)

    @pytest.mark.parametrize(("name", "text", "message"), [
        ("job.yaml", "model: [unclosed", "not valid YAML"),
        ("job.json", "{", "not valid JSON"),
        ("job.yaml", "- a list", "must be a mapping"),
    ])
    def test_a_bad_job_file_says_what_is_wrong(self, tmp_path, name, text, message):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(CliError, match=message):
            load_job_file(path)


class TestFollowAndList:
    def test_follow_prints_each_state_and_ends_with_the_job(self, api, job_file):
        job = submit(api, load_job_file(job_file), base_dir=job_file.parent)
        assert api.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        out = io.StringIO()
        assert follow(api, job["id"], out) == 1  # only success exits 0
        assert out.getvalue().splitlines() == ["state: queued", "state: cancelled (cancelled while queued)"]

    def test_jobs_table(self, api, job_file):
        job = submit(api, load_job_file(job_file), base_dir=job_file.parent)
        table = format_jobs(api.get("/v1/jobs").json()["data"]).splitlines()
        assert table[0].split() == ["ID", "NAME", "STATUS", "STEP", "LOSS", "BEST", "TIME", "GPUS", "OWNER",
                                    "MODEL", "CREATED"]
        assert table[1].split()[:10] == [job["id"], "-", "queued", "0/5", "-", "-", "-", "1", "admin", "tiny"]


def test_event_lines_for_people():
    assert progress_line({"step": 3, "total_steps": 6, "loss": 1.23456, "tokens_per_s": 12345.6}) == (
        "[###############---------------] step 3/6  loss 1.2346  12,346 tok/s")
    dpo = {"step": 2, "total_steps": 4, "loss": 0.5, "reward_margin": 0.4567, "reward_accuracy": 0.75, "tokens_per_s": 900.0}
    assert progress_line(dpo) == "[###############---------------] step 2/4  loss 0.5000  margin 0.457 acc 0.75  900 tok/s"
    assert describe("checkpoint", {"step": 6, "final": True}) == "checkpoint: step 6 (final)"
    assert describe("state", {"status": "failed", "error_code": "out_of_memory"}) == "state: failed (out_of_memory)"


def test_a_jobs_gpus_show_its_count_and_while_it_runs_the_gpus_it_holds():
    assert gpus_cell({"gpus": 2, "held_gpus": []}) == "2"
    held = [{"worker": "box", "slot": 0, "device": "3"}, {"worker": "box", "slot": 1, "device": "5"}]
    assert gpus_cell({"gpus": 2, "held_gpus": held}) == "2@box:3,5"
    cpu = [{"worker": "cpu-box", "slot": 2, "device": None}]
    assert gpus_cell({"gpus": 1, "held_gpus": cpu}) == "1@cpu-box:2"
    assert describe("state", {"status": "running", "worker_id": "box", "attempt": 1, "slots": [0, 1]}) == (
        "state: running (on box, GPU slots 0,1)")


def test_a_multi_rank_plan_line_names_the_ranks_backend_and_interconnect():
    plan = {"hardware": {"device": "cuda", "interconnect": "NVLink"}, "total_steps": 9, "world_size": 4,
            "decisions": [{"name": "parallelism", "requested": "auto", "enabled": True, "backend": "fsdp2", "reason": "full"}]}
    assert describe("plan", plan) == "plan: cuda, 4 ranks (fsdp2, NVLink), 9 steps, optimizations on: none"


def test_plan_line_names_the_optimizations_on_not_the_kernel_choices():
    def decision(name: str, enabled: bool) -> dict:
        return {"name": name, "requested": "auto", "enabled": enabled, "backend": "x", "reason": "y"}

    plan = {"hardware": {"device": "cuda"}, "total_steps": 9, "decisions": [
        decision("attention", True), decision("loss", True), decision("lora_kernel", True),
        decision("fused_ops", False), decision("packed_metadata_cache", True), decision("moe_grouped_routing", False),
    ]}
    assert describe("plan", plan) == "plan: cuda, 9 steps, optimizations on: lora_kernel, packed_metadata_cache"
