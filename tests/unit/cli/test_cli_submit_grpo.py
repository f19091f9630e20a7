"""``ftq submit`` of a GRPO job file naming a local prompts file: uploaded as ``format=prompts``."""

from __future__ import annotations

import json

import yaml

from cli.jobs import load_job_file, submit

GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
          "operation": "eq"}


def test_a_grpo_job_files_prompts_are_uploaded_as_prompts(api, tmp_path):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "2 + 2 =", "answer": "4"}) + "\n")
    job_file = tmp_path / "grpo.yaml"
    job_file.write_text(yaml.safe_dump({"model": "tiny", "training_file": "prompts.jsonl", "objective": "grpo",
                                        "grpo": {"graders": GRADER, "group_size": 4, "max_new_tokens": 16},
                                        "hyperparameters": {"max_steps": 5, "batch_tokens": 256}}))
    job = submit(api, load_job_file(job_file), base_dir=tmp_path)
    assert job["spec"]["objective"] == "grpo" and job["preflight"]["format"] == "prompts", job
    assert api.get(f"/v1/files/{job['spec']['training_file']}").json()["format"] == "prompts"
