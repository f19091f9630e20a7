"""``core.jobs.prompt_lengths``: the limit from a config and the box's cap, the prompts counted as
the trainer encodes them (the tiny model's tokenizer), the refusal naming the line and the field to
change, and the counts added to the submission's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from core.errors import InvalidDataset
from core.jobs.prompt_lengths import Limit, add_counts, context_limit, count, too_long
from trainer.generate.job import encode
from trainer.generate.prompts import read_prompts

CONFIG_LIMIT = "max_position_embeddings of its config.json"


class TestContextLimit:
    @pytest.mark.parametrize(("config", "cap", "expected"), [
        ({"max_position_embeddings": 4096}, None, Limit(4096, CONFIG_LIMIT)),
        ({"max_position_embeddings": 4096}, 1024, Limit(1024, "FTQ_GENERATE_MAX_LEN")),
        ({"max_position_embeddings": 512}, 1024, Limit(512, CONFIG_LIMIT)),
        ({"text_config": {"max_position_embeddings": 8192}}, None, Limit(8192, CONFIG_LIMIT)),
        ({}, 100, Limit(100, "FTQ_GENERATE_MAX_LEN")),
        ({"max_position_embeddings": True}, None, None),
        ({}, None, None),
    ])
    def test_the_lower_of_the_models_context_and_the_cap(self, config, cap, expected) -> None:
        assert context_limit(config, cap) == expected


class TestTooLong:
    def test_a_prompt_that_fits_alone_names_max_tokens_and_the_most_it_may_be(self) -> None:
        refusal = too_long(3, 100, 50, Limit(120, CONFIG_LIMIT))
        assert (refusal.param, refusal.line) == ("sampling.max_tokens", 3)
        assert refusal.message == ("prompts_file: line 3: the prompt is 100 tokens + sampling.max_tokens 50 = 150, "
                                   f"over the 120 the model holds ({CONFIG_LIMIT}); set sampling.max_tokens to at most "
                                   "20 or shorten the prompt")

    def test_a_prompt_that_fills_the_context_alone_names_the_prompt(self) -> None:
        refusal = too_long(1, 2000, 1, Limit(2000, "FTQ_GENERATE_MAX_LEN"))
        assert (refusal.param, refusal.line) == ("prompts_file", 1)
        assert "the prompt is 2,000 tokens, the model holds 2,000 (FTQ_GENERATE_MAX_LEN)" in refusal.message


class TestCount:
    @pytest.fixture
    def prompts(self, tmp_path: Path) -> Path:
        path = tmp_path / "p.jsonl"
        lines = [{"prompt": "Once upon a time"}, {"messages": [{"role": "user", "content": "Say hello."}]},
                 {"prompt": " ".join(["word"] * 30)}]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n")
        return path

    def test_each_prompt_is_counted_as_the_trainer_encodes_it(self, model_root: Path, prompts: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_root / "tiny")
        lengths = [len(encode(p, tokenizer)) for p in read_prompts(prompts)]
        counted = count(tokenizer, str(prompts), 8, Limit(max(lengths) + 8, CONFIG_LIMIT))
        assert counted == {"tokens": sum(lengths), "longest": max(lengths), "capped": False}
        seen: list[tuple[str, int]] = []
        count(tokenizer, str(prompts), 1, Limit(4096, CONFIG_LIMIT), progress=lambda p, n: seen.append((p, n)))
        assert seen == [("prompts_file", 1), ("prompts_file", 2), ("prompts_file", 3)]

    def test_the_first_prompt_over_the_limit_is_refused(self, model_root: Path, prompts: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_root / "tiny")
        lengths = [len(encode(p, tokenizer)) for p in read_prompts(prompts)]
        with pytest.raises(InvalidDataset) as refused:
            count(tokenizer, str(prompts), 8, Limit(lengths[2] + 7, CONFIG_LIMIT))
        assert (refused.value.line, refused.value.param) == (3, "sampling.max_tokens")


class TestAddCounts:
    def test_the_counts_and_the_limit_go_into_the_report(self) -> None:
        report = {"checked": True, "records": 2, "note": "2 prompts (1 chat, 1 text)"}
        added = add_counts(report, {"tokens": 30, "longest": 20, "capped": False}, 64, Limit(4096, CONFIG_LIMIT))
        assert added == {**report, "tokens": 30, "max_seq_len": 4096, "capped": False,
                         "note": "2 prompts (1 chat, 1 text); the longest prompt is 20 tokens: with sampling.max_tokens "
                                 f"64 within the 4,096 the model holds ({CONFIG_LIMIT})"}

    def test_a_model_that_was_not_checked_says_so(self) -> None:
        added = add_counts({"checked": True, "note": "1 prompts"}, None, 64, None)
        assert added["note"].endswith("prompt lengths not checked (the model is not a local directory with a known "
                                      "context)") and "tokens" not in added
