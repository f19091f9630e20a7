"""``ftq show`` as a summary for people (``--json`` as before), and ``sample`` events as text."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from cli import jobs
from cli.jobs import describe, load_job_file, submit
from cli.main import main
from cli.show import format_job, next_commands
from core.db import make_engine, make_sessionmaker
from core.jobs import service
from core.jobs.states import JobStatus
from core.migrate import upgrade
from core.settings import Settings
from tests.helpers import create_api_key
from worker.recorder import apply_events

PLAN = {"type": "plan", "device": "cuda", "dtype": "bfloat16", "world_size": 1, "total_steps": 4,
        "hardware": {"device": "cuda", "name": "NVIDIA H100"},
        "decisions": [
            {"name": "attention", "requested": "auto", "enabled": True, "backend": "varlen", "reason": "packed rows"},
            {"name": "packed_metadata_cache", "requested": "auto", "enabled": True, "backend": None,
             "reason": "one host sync per batch"},
            {"name": "double_buffered_reload", "requested": "auto", "enabled": False, "backend": None,
             "reason": "the model fits: nothing to reload"},
        ]}


@pytest.fixture
def box(tmp_path: Path, model_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The app on a fresh SQLite store, ``ftq``'s client commands pointed at it, a session maker."""
    settings = Settings(data_dir=tmp_path / "data", model_root=model_root, allow_hub_models=False,
                        sse_poll_interval_s=0.05).resolved()
    upgrade(settings.database_url)
    key = create_api_key(settings.database_url)
    engine = make_engine(settings.database_url)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {key}"}) as client:
        monkeypatch.setattr(jobs, "connect", lambda: contextlib.nullcontext(client))
        yield SimpleNamespace(client=client, sessions=make_sessionmaker(engine))
    engine.dispose()


def trained(box: SimpleNamespace, job_file: Path, status: JobStatus, **error: str) -> str:
    """A job the worker ran: its plan, four steps, a checkpoint at step 2, a sample, then ``status``."""
    job_id = submit(box.client, load_job_file(job_file), base_dir=job_file.parent)["id"]
    steps = [{"type": "step", "step": s, "total_steps": 4, "epoch": s / 2, "loss": 2.0 / s, "grad_norm": 1.0,
              "tokens": 100, "tokens_per_s": 1000.0 * s} for s in range(1, 5)]
    checkpoint = {"type": "checkpoint", "step": 2, "path": "/x", "bytes": 2, "final": False}
    sample = {"type": "sample", "step": 2, "final": False,
              "samples": [{"prompt": "hi", "completion": "hé\ufffd", "tokens": 2}]}
    with box.sessions() as session:
        service.transition(session, job_id, JobStatus.running)
        apply_events(session, job_id, [PLAN, *steps[:2], checkpoint, sample, *steps[2:]])
        service.transition(session, job_id, status, **error)
        session.commit()
    return job_id


class TestShow:
    def test_a_failed_job_reads_as_a_summary(self, box, job_file, capsys):
        job_id = trained(box, job_file, JobStatus.failed, error_code="out_of_memory",
                         error_message="CUDA out of memory; lower batch_tokens\n--- stderr ---\nTraceback")
        assert main(["show", job_id]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"{job_id}  failed"
        text = "\n".join(lines)
        assert "  progress     step 4/4 (100%), epoch 2.00" in lines
        assert "  train loss   last 0.5000, best 0.5000" in lines
        assert "  speed        2,500 tokens/s (mean of the last 4 steps); 400 tokens trained" in lines
        assert "  plan         cuda (NVIDIA H100), bfloat16, 1 rank" in lines
        assert "    on   packed_metadata_cache   one host sync per batch" in lines
        assert "    off  double_buffered_reload  the model fits: nothing to reload" in lines
        assert "  error        out_of_memory: CUDA out of memory; lower batch_tokens" in lines
        assert f"  checkpoints  step 2: ftq download {job_id} --step 2" in lines
        assert f"ftq resume {job_id}" in text and "{" not in text

    def test_json_prints_the_apis_object(self, box, job_file, capsys):
        job_id = trained(box, job_file, JobStatus.succeeded)
        assert main(["show", job_id, "--json"]) == 0
        job = json.loads(capsys.readouterr().out)
        assert job["id"] == job_id and job["plan"]["dtype"] == "bfloat16"

    def test_a_queued_job_shows_its_place_and_no_plan_yet(self, box, job_file, capsys):
        job_id = submit(box.client, load_job_file(job_file), base_dir=job_file.parent)["id"]
        assert main(["show", job_id]) == 0
        out = capsys.readouterr().out
        assert "  queue        queued at position 1 (0 ahead)" in out and "  plan         not yet" in out
        assert f"  cancel       ftq cancel {job_id}" in out and "speed" not in out


def test_a_succeeded_job_says_where_to_download_it():
    job = {"id": "job-1", "status": "succeeded", "method": "lora"}
    rows = dict(next_commands(job, [{"step": 2, "final": False}, {"step": 4, "final": True}],
                              [{"format": "gguf", "quantization": "q8_0", "status": "succeeded"}]))
    assert rows["download"] == "ftq download job-1  (the adapter, zip; --format tar.gz)"
    assert rows["export"] == "ftq export job-1 --format merged|gguf"
    assert rows["exports"] == "gguf/q8_0 succeeded: ftq exports job-1"
    assert rows["checkpoints"] == "step 2, 4 (final): ftq download job-1 --step 4"
    assert "resume" not in rows and "cancel" not in rows


def test_a_job_with_a_validation_set_shows_its_eval_losses():
    job = {"id": "job-1", "name": "lr", "status": "running", "model": "tiny", "method": "lora", "gpus": 2,
           "priority": "normal", "owner": "ann", "created_at": "2026-01-02T10:00:00", "started_at": None,
           "validation_file": "file-1", "progress": {"step": 0, "total_steps": None}, "plan": None,
           "summary": {"final_eval_loss": 1.5, "best_eval_loss": 1.25, "best_eval_step": 20}}
    text = format_job(job, [], [], [])
    assert text.splitlines()[0] == 'job-1  "lr"  running'
    assert "  model        tiny (lora), 2 GPUs, owner ann, priority normal" in text
    assert "  eval loss    last 1.5000, best 1.2500 at step 20" in text


class TestSampleEvents:
    def test_a_sample_is_prompt_then_completion_as_text(self):
        data = {"step": 40, "final": True, "samples": [
            {"prompt": "Say hi", "completion": "h\u00e9llo \ufffd", "tokens": 3},
            {"prompt": "two\nlines", "completion": "", "tokens": 0},
        ]}
        assert describe("sample", data).splitlines() == [
            "sample: step 40 (final)",
            "  Say hi → h\u00e9llo \ufffd  (3 tokens)",
            "  two",
            "    lines → (nothing: end of sequence first)  (0 tokens)",
        ]

    def test_control_characters_are_escaped_not_sent_to_the_terminal(self):
        data = {"step": 1, "samples": [{"prompt": "a", "completion": "\x1b[2Jb\tc", "tokens": 1}]}
        assert describe("sample", data).splitlines()[1] == "  a → \\x1b[2Jb\tc  (1 token)"

    def test_a_grpo_steps_rollouts_are_reward_prompt_and_completion(self):
        data = {"step": 7, "rollouts": [
            {"prompt": "2 + 2 =", "completion": " 4", "reward": 1.0, "scores": {"exact": 1.0}},
            {"prompt": "2 + 2 =", "completion": "\x1b[2J5", "reward": 0.0, "scores": {"exact": 0.0}},
        ]}
        assert describe("rollouts", data).splitlines() == [
            "rollouts: step 7", "  [reward 1.0] 2 + 2 = →  4", "  [reward 0.0] 2 + 2 = → \\x1b[2J5"]

    def test_other_events_print_their_text_unescaped(self):
        assert describe("skip", {"step": 3, "note": "é"}) == 'skip: {"step": 3, "note": "é"}'

    def test_logs_prints_a_jobs_samples(self, box, job_file, capsys):
        job_id = trained(box, job_file, JobStatus.succeeded)
        with box.sessions() as session:
            service.append_events(session, job_id, [service.state_event(JobStatus.succeeded)])
            session.commit()
        assert main(["logs", job_id]) == 0
        out = capsys.readouterr().out
        assert "sample: step 2\n  hi → hé\ufffd  (2 tokens)\n" in out and "\\ufffd" not in out
