"""The prompts file's reader: chat and text lines, and a refusal that names the line and the field."""

from __future__ import annotations

import pytest

from trainer.generate.prompts import CHAT, TEXT, PromptError, read_prompts


def _file(tmp_path, text: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    return path


class TestReadPrompts:
    def test_reads_chat_and_text_lines_in_order_skipping_blank_lines(self, tmp_path):
        path = _file(tmp_path, '{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}], "id": 3}\n')
        prompts = read_prompts(path)
        assert [(p.index, p.line, p.fmt) for p in prompts] == [(0, 1, TEXT), (1, 3, CHAT)]
        assert prompts[1].record["id"] == 3

    @pytest.mark.parametrize(("line", "field", "says"), [
        ('{"prompt": "a"', None, "not JSON"),
        ('["a"]', None, "JSON object"),
        ('{"text": "a"}', "prompt", "neither"),
        ('{"prompt": "a", "messages": []}', "messages", "both"),
        ('{"prompt": ""}', "prompt", "non-empty string"),
        ('{"messages": []}', "messages", "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "a"}]}', "messages[0].role", "role must be"),
        ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content", "content must be"),
    ])
    def test_a_bad_line_is_refused_naming_its_line_and_field(self, tmp_path, line, field, says):
        with pytest.raises(PromptError, match=says) as refused:
            read_prompts(_file(tmp_path, '{"prompt": "fine"}\n' + line + "\n"))
        assert refused.value.line == 2 and refused.value.field == field
        assert str(refused.value).startswith("line 2:")

    def test_an_empty_file_and_too_many_prompts_are_refused(self, tmp_path):
        with pytest.raises(PromptError, match="no prompt"):
            read_prompts(_file(tmp_path, "\n"))
        with pytest.raises(PromptError, match="more than 1 prompts") as refused:
            read_prompts(_file(tmp_path, '{"prompt": "a"}\n{"prompt": "b"}\n'), limit=1)
        assert refused.value.line == 2
