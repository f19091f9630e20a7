"""ShareGPT and Alpaca conversion (core.files.convert): a field of the wrong type is refused naming
the line and the field, never dropped, and lines are capped while they are read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.errors import InvalidDataset
from core.files import convert, validate

SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
ALPACA = {"instruction": "Add one.", "output": "2"}


def write(tmp_path: Path, *records: Any) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def converted(path: Path, layout: str | None = None) -> list[dict[str, Any]]:
    result = convert.convert_to_chat(path, layout)
    assert result is not None
    return [json.loads(line)["messages"] for line in result[0].read_text(encoding="utf-8").splitlines()]


def refused(tmp_path: Path, record: dict[str, Any], layout: str | None = None) -> str:
    path = write(tmp_path, SHAREGPT if "conversations" in record else ALPACA, record)
    with pytest.raises(InvalidDataset) as caught:
        convert.convert_to_chat(path, layout)
    assert caught.value.line == 2
    assert not (tmp_path / "d.jsonl.chat.jsonl").exists(), "a refused conversion leaves no half-written file"
    return caught.value.message


class TestShareGPTFieldTypes:
    @pytest.mark.parametrize(("system", "kind"), [(7, "a number (7)"), ({"text": "be brief"}, "an object"),
                                                  (["be", "brief"], "an array"), (True, "a boolean (true)")])
    def test_system_of_another_type_is_refused_naming_it(self, tmp_path, system, kind) -> None:
        message = refused(tmp_path, {**SHAREGPT, "system": system})
        assert message == f"line 2: 'system' must be a string (or absent), not {kind}"

    @pytest.mark.parametrize(("turn", "fragment"), [
        ({"from": 1, "value": "hi"}, "conversations[0].from must be a string, not a number (1)"),
        ({"from": "human", "value": 5}, "conversations[0].value must be a string, not a number (5)"),
        ({"from": "human"}, "conversations[0].value must be a string, not null"),
        ("human: hi", "conversations[0] must be an object with a string 'from' and 'value', not a string"),
    ])
    def test_a_turn_of_another_type_is_refused_naming_the_field(self, tmp_path, turn, fragment) -> None:
        assert refused(tmp_path, {"conversations": [turn, SHAREGPT["conversations"][1]]}) == f"line 2: {fragment}"

    def test_conversations_that_are_not_a_list_name_the_field(self, tmp_path) -> None:
        message = refused(tmp_path, {"conversations": "human: hi"}, layout="sharegpt")
        assert message == "line 2: 'conversations' must be a list of {from, value} objects, not a string"

    def test_a_string_system_is_kept_and_null_is_absent(self, tmp_path) -> None:
        path = write(tmp_path, {**SHAREGPT, "system": "Be brief."}, {**SHAREGPT, "system": None})
        first, second = converted(path)
        assert first[0] == {"role": "system", "content": "Be brief."}
        assert second[0]["role"] == "user"


class TestAlpacaFieldTypes:
    @pytest.mark.parametrize(("value", "kind"), [(0, "a number (0)"), (False, "a boolean (false)"),
                                                 (["x"], "an array"), ({"x": 1}, "an object")])
    def test_input_of_another_type_is_refused_not_dropped(self, tmp_path, value, kind) -> None:
        assert refused(tmp_path, {**ALPACA, "input": value}) == f"line 2: 'input' must be a string (or absent), not {kind}"

    def test_system_as_a_list_is_refused(self, tmp_path) -> None:
        message = refused(tmp_path, {**ALPACA, "system": ["be", "brief"]})
        assert message == "line 2: 'system' must be a string (or absent), not an array"

    @pytest.mark.parametrize(("key", "value", "kind"), [("instruction", 3, "a number (3)"), ("output", None, "null"),
                                                        ("output", {"text": "2"}, "an object")])
    def test_instruction_and_output_of_another_type_name_the_field(self, tmp_path, key, value, kind) -> None:
        message = refused(tmp_path, {**ALPACA, key: value}, layout="alpaca")
        assert message == f"line 2: an Alpaca record needs '{key}' as a string, not {kind}"

    @pytest.mark.parametrize(("history", "fragment"), [
        ("q a", "'history' must be a list of [user, assistant] pairs (or absent), not a string"),
        ([["q", 1]], 'history[0] must be a [user, assistant] pair of strings, not ["q", 1]'),
        ([{"user": "q"}], "history[0] must be a [user, assistant] pair of strings, not an object"),
    ])
    def test_history_of_another_shape_is_refused(self, tmp_path, history, fragment) -> None:
        assert refused(tmp_path, {**ALPACA, "history": history}) == f"line 2: {fragment}"

    def test_empty_and_null_optional_fields_convert(self, tmp_path) -> None:
        path = write(tmp_path, {**ALPACA, "input": "", "system": None, "history": None},
                     {**ALPACA, "input": "3", "history": [["q", "a"]]})
        first, second = converted(path)
        assert first == [{"role": "user", "content": "Add one."}, {"role": "assistant", "content": "2"}]
        assert second[:2] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        assert second[2] == {"role": "user", "content": "Add one.\n\n3"}


class TestLineCap:
    @pytest.mark.parametrize("layout", [None, "sharegpt"])
    def test_a_line_over_the_cap_is_refused_before_it_is_read_whole(self, tmp_path, monkeypatch, layout) -> None:
        monkeypatch.setattr(validate, "MAX_LINE_BYTES", 1024)
        reads: list[int] = []
        parsed: list[int] = []
        monkeypatch.setattr(validate, "parse_json_line", lambda raw, number: parsed.append(number))
        path = tmp_path / "d.jsonl"
        line = json.dumps({"conversations": [{"from": "human", "value": "x" * 100_000}]})
        path.write_text(line + "\n", encoding="utf-8")
        real_open = Path.open

        def spying_open(self: Path, *args: Any, **kwargs: Any) -> Any:
            handle = real_open(self, *args, **kwargs)
            readline = handle.readline
            handle.readline = lambda size=-1: reads.append(size) or readline(size)  # type: ignore[method-assign]
            return handle

        monkeypatch.setattr(Path, "open", spying_open)
        with pytest.raises(InvalidDataset, match=r"^line 1: longer than 1024 bytes; split the record$"):
            convert.convert_to_chat(path, layout)
        assert reads and all(0 < size <= 1025 for size in reads), "every read is bounded by the cap"
        assert parsed == [], "the long line is never parsed"
