"""``ftq generate``: the flags become the generation spec; progress events read as one line."""

from __future__ import annotations

from cli.generate import format_generation_job, spec_of
from cli.jobs import describe, format_jobs
from cli.main import build_parser


class TestGenerateCommand:
    def test_flags_become_the_spec_and_unset_ones_keep_the_api_defaults(self) -> None:
        args = build_parser().parse_args(["generate", "job:job-1a@40", "p.jsonl", "--max-tokens", "32", "--seed", "1",
                                          "--stop", "\n\n", "--stop", "END", "--logprobs", "--gpus", "2"])
        assert spec_of(args, "file-" + "0" * 24) == {
            "kind": "generate", "model": "job:job-1a@40", "prompts_file": "file-" + "0" * 24, "gpus": 2,
            "sampling": {"max_tokens": 32, "seed": 1, "stop": ["\n\n", "END"], "logprobs": True},
        }
        bare = build_parser().parse_args(["generate", "tiny-llama", "p.jsonl"])
        assert spec_of(bare, "file-x")["sampling"] == {}

    def test_a_progress_event_reads_prompts_done_and_the_rate(self) -> None:
        data = {"stage": "generate", "prompts_done": 3, "prompts_total": 8, "tokens": 90, "tokens_per_s": 1234.5}
        assert describe("progress", data) == "progress: 3/8 prompts, 1,234 tok/s"
        assert describe("progress", {**data, "tokens_per_s": None}) == "progress: 3/8 prompts"

    def test_ftq_jobs_and_show_read_prompts_and_the_next_commands(self) -> None:
        job = {"id": "job-1", "kind": "generate", "name": None, "status": "cancelled", "progress": {"step": 0,
               "total_steps": None}, "summary": None, "generation": {"prompts_done": 3, "prompts_total": 8,
               "tokens": 90, "tokens_per_s": 12.0}, "gpus": 1, "owner": "alice", "model": "job:job-0@4",
               "priority": "normal", "training_file": "file-x", "spec": {"sampling": {"n": 1}}, "held_gpus": [],
               "created_at": "2026-11-27T17:00:00", "started_at": None, "finished_at": None, "error": None}
        assert "3/8p" in format_jobs([job]).splitlines()[1]
        shown = format_generation_job(job)
        assert "3/8 prompts, 12 tokens/s" in shown and "ftq resume job-1" in shown and "ftq completions job-1" in shown
