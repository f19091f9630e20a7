"""core.files.validate takes OpenAI's chat JSONL unchanged: weight, tools, tool_calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import InvalidDataset
from core.files.validate import validate_dataset

CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def write(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_openai_chat_with_weights_tools_and_calls_is_accepted(tmp_path):
    record = {"tools": TOOLS, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "weight": 0},
    ]}
    summary = validate_dataset(write(tmp_path, record, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": 1}]}))
    assert (summary.format, summary.num_records) == ("chat", 2)


@pytest.mark.parametrize(("message", "needle"), [
    ({"role": "assistant", "content": "x", "weight": 0.5}, "'weight' must be 0 (not trained) or 1, got 0.5"),
    ({"role": "user", "content": "x", "weight": 1}, "'weight' applies to assistant messages only"),
])
def test_a_bad_weight_names_its_line_and_message(tmp_path, message, needle):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [{"role": "user", "content": "a"}, message, {"role": "assistant", "content": "b"}]}
    with pytest.raises(InvalidDataset) as info:
        validate_dataset(write(tmp_path, good, bad))
    assert info.value.line == 2
    assert info.value.message.startswith("line 2: messages[1]") and needle in info.value.message


def test_a_conversation_whose_answers_all_weigh_zero_is_refused(tmp_path):
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]}
    with pytest.raises(InvalidDataset) as info:
        validate_dataset(write(tmp_path, record))
    assert info.value.line == 1 and "a weight other than 0" in info.value.message


def test_tools_must_be_a_list_of_objects(tmp_path):
    record = {"tools": "weather", "messages": [{"role": "user", "content": "a"},
                                               {"role": "assistant", "content": "b"}]}
    with pytest.raises(InvalidDataset) as info:
        validate_dataset(write(tmp_path, record))
    assert info.value.line == 1 and "'tools' must be a list" in info.value.message
