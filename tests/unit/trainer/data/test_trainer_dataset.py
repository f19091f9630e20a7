"""Dataset formats: which tokens carry loss, truncation, and errors that name the line."""

from __future__ import annotations

import pytest
from trainer_helpers import write_jsonl

from trainer.data.dataset import IGNORE_INDEX, load_samples, tokenize_record
from trainer.errors import DatasetError


def _labelled_text(tokenizer, sample) -> str:
    return tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])


class TestChat:
    def test_loss_only_on_assistant_turns_including_their_eos(self, tiny_tokenizer):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is two?"},
            {"role": "assistant", "content": "A number."},
            {"role": "user", "content": "And three?"},
            {"role": "assistant", "content": "Also a number."},
        ]
        sample = tokenize_record({"messages": messages}, "chat", tiny_tokenizer)
        assert (
            _labelled_text(tiny_tokenizer, sample)
            == "A number.<|eos|>\nAlso a number.<|eos|>\n"
        )
        full = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
        assert tiny_tokenizer.decode(sample.input_ids) == full
        assert sample.labels[0] == IGNORE_INDEX  # bos

    def test_user_tokens_are_masked(self, tiny_tokenizer):
        sample = tokenize_record(
            {
                "messages": [
                    {"role": "user", "content": "secret prompt"},
                    {"role": "assistant", "content": "ok"},
                ]
            },
            "chat",
            tiny_tokenizer,
        )
        assert "secret" not in _labelled_text(tiny_tokenizer, sample)
        assert sum(label != IGNORE_INDEX for label in sample.labels) < len(sample) / 2


class TestPromptCompletionAndText:
    def test_prompt_completion_learns_the_completion_and_eos_only(self, tiny_tokenizer):
        sample = tokenize_record(
            {"prompt": "The sky is", "completion": " blue."},
            "prompt_completion",
            tiny_tokenizer,
        )
        assert _labelled_text(tiny_tokenizer, sample) == " blue.<|eos|>"
        assert sample.input_ids[0] == tiny_tokenizer.bos_token_id

    def test_text_learns_every_token(self, tiny_tokenizer):
        sample = tokenize_record({"text": "The river is loud."}, "text", tiny_tokenizer)
        assert sample.labels == sample.input_ids
        assert sample.input_ids[-1] == tiny_tokenizer.eos_token_id


class TestLoadSamples:
    def test_auto_detects_format_and_truncates(self, tmp_path, tiny_tokenizer):
        path = write_jsonl(
            tmp_path / "d.jsonl", [{"text": "word " * 100}, {"text": "short"}]
        )
        samples = load_samples(path, tiny_tokenizer, "auto", max_seq_len=16)
        assert len(samples[0]) == 16 and len(samples[1]) < 16

    def test_bad_json_line_is_named(self, tmp_path, tiny_tokenizer):
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "a"}\n\n{"text": broken}\n')
        with pytest.raises(DatasetError, match=r"line 3: not valid JSON"):
            load_samples(path, tiny_tokenizer)

    def test_mixed_formats_name_the_line(self, tmp_path, tiny_tokenizer):
        path = write_jsonl(
            tmp_path / "d.jsonl", [{"text": "a"}, {"prompt": "p", "completion": "c"}]
        )
        with pytest.raises(
            DatasetError,
            match=r"line 2: expected a text record, found prompt_completion",
        ):
            load_samples(path, tiny_tokenizer)

    def test_chat_without_assistant_is_refused(self, tmp_path, tiny_tokenizer):
        path = write_jsonl(
            tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]
        )
        with pytest.raises(DatasetError, match="line 1: no assistant message"):
            load_samples(path, tiny_tokenizer)

    def test_prompt_longer_than_max_seq_len_everywhere_is_an_error(
        self, tmp_path, tiny_tokenizer
    ):
        path = write_jsonl(
            tmp_path / "d.jsonl", [{"prompt": "word " * 50, "completion": "x"}]
        )
        with pytest.raises(DatasetError, match="raise data.max_seq_len"):
            load_samples(path, tiny_tokenizer, max_seq_len=8)

    def test_missing_file(self, tmp_path, tiny_tokenizer):
        with pytest.raises(DatasetError, match="not found"):
            load_samples(tmp_path / "nope.jsonl", tiny_tokenizer)
