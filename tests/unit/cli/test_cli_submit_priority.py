"""``ftq submit``: a job file's ``priority`` (or ``--priority``) reaches the API; the queue line."""

from __future__ import annotations

import contextlib

import yaml

from cli.jobs import load_job_file, queue_line, submit
from cli.main import build_parser


def test_a_job_files_priority_is_submitted(api, job_file):
    body = {**load_job_file(job_file), "priority": "high"}
    job = submit(api, body, base_dir=job_file.parent)
    assert job["priority"] == "high" and job["queue"]["position"] == 1


def test_the_priority_flag_overrides_the_file(api, job_file, monkeypatch, capsys):
    from cli import jobs

    job_file.write_text(yaml.safe_dump({**load_job_file(job_file), "priority": "low"}))
    monkeypatch.setattr(jobs, "connect", lambda: contextlib.nullcontext(api))
    args = build_parser().parse_args(["submit", str(job_file), "--priority", "high"])
    assert args.run(args) == 0
    out = capsys.readouterr()
    job = api.get(f"/v1/jobs/{out.out.strip()}").json()
    assert job["priority"] == "high"
    assert out.err.strip() == "queued at position 1 (0 ahead), start time unknown"


def test_the_queue_line_names_the_estimate():
    line = queue_line({"position": 3, "ahead": ["a", "b"], "estimated_start_at": "2026-11-22T04:10:05+00:00"})
    assert line == "queued at position 3 (2 ahead), estimated start 2026-11-22 04:10 UTC"


def test_the_queue_line_says_when_the_job_holds_a_hosts_gpus():
    line = queue_line({"position": 1, "ahead": [], "estimated_start_at": None, "holds": "box"})
    assert line == "queued at position 1 (0 ahead), start time unknown; holding the free GPUs of box until it starts"
