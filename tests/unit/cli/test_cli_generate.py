"""``ftq generate``: the flags become the generation spec; progress events read as one line."""

from __future__ import annotations

from cli.jobs import describe
from cli.main import build_parser
from cli.generate import spec_of


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
