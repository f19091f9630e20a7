"""core.files.validate: each bad case gives its line and reason; good files are described."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import InvalidDataset
from core.files.validate import validate_dataset

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]}


def write(tmp_path: Path, *lines: object, raw: bytes | None = None) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_bytes(raw if raw is not None else "".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines
    ).encode())
    return path


def refusal(path: Path) -> tuple[int | None, str]:
    with pytest.raises(InvalidDataset) as info:
        validate_dataset(path)
    assert info.value.message.startswith(f"line {info.value.line}") or "no records" in info.value.message
    return info.value.line, info.value.message


class TestGoodFiles:
    def test_chat(self, tmp_path: Path) -> None:
        system = {"messages": [{"role": "system", "content": "be brief"}, *CHAT["messages"],
                               {"role": "tool", "content": "42", "tool_call_id": "t1"}]}
        summary = validate_dataset(write(tmp_path, CHAT, "", system))
        assert (summary.format, summary.num_records) == ("chat", 2)
        assert summary.stats["chars_per_record"] == {"min": 8, "mean": 13.0, "max": 18}
        assert summary.stats["messages_per_record_mean"] == 3.0

    def test_prompt_completion_and_text(self, tmp_path: Path) -> None:
        pc = validate_dataset(write(tmp_path, {"prompt": "", "completion": "yes", "id": 1}))
        assert (pc.format, pc.num_records, pc.stats["total_chars"]) == ("prompt_completion", 1, 3)
        text = validate_dataset(write(tmp_path, {"text": "abc"}, {"text": "de"}))
        assert (text.format, text.num_records) == ("text", 2)

    def test_bom_and_crlf_are_accepted(self, tmp_path: Path) -> None:
        raw = b"\xef\xbb\xbf" + json.dumps({"text": "a"}).encode() + b"\r\n" + json.dumps({"text": "b"}).encode()
        assert validate_dataset(write(tmp_path, raw=raw)).num_records == 2


class TestBadFiles:
    @pytest.mark.parametrize(
        ("lines", "line", "fragment"),
        [
            ((), 1, "no records"),
            (("", "   "), 1, "no records"),
            (({"text": "a"}, "{oops"), 2, "not valid JSON"),
            (({"text": "a"}, "3"), 2, "a JSON int, not an object"),
            (({"text": "a"}, CHAT), 2, "a chat record, but line 1 is text"),
            (({"text": "a", "prompt": "b", "completion": "c"},), 1, "mixes the keys of prompt_completion and text"),
            (({"messages": [{"content": "x"}]},), 1, "messages[0] has no 'role'"),
            (({"messages": [{"role": "bot", "content": "x"}]},), 1, "role 'bot' is not one of"),
            (({"messages": [{"role": "user"}]},), 1, "needs 'content' as a string"),
            (({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]},), 1,
             "no assistant message with content"),
            (({"messages": []},), 1, "non-empty list"),
            (({"messages": ["hi"]},), 1, "messages[0] must be an object"),
            (({"prompt": "p"},), 1, "'completion' is missing"),
            (({"prompt": 1, "completion": "c"},), 1, "'prompt' must be a string"),
            (({"prompt": "p", "completion": ""},), 1, "'completion' is empty"),
            (({"text": ""},), 1, "'text' is empty"),
            (({"text": ["a"]},), 1, "'text' must be a string"),
            (({"input": "a", "output": "b"},), 1, "found keys: input, output"),
        ],
    )
    def test_first_bad_line_and_reason(self, tmp_path: Path, lines: tuple, line: int, fragment: str) -> None:
        got_line, message = refusal(write(tmp_path, *lines))
        assert got_line == line
        assert fragment in message

    def test_not_utf8(self, tmp_path: Path) -> None:
        line, message = refusal(write(tmp_path, raw=b'{"text": "a"}\n{"text": "\xe9"}\n'))
        assert line == 2 and "not UTF-8" in message

    def test_only_the_first_bad_line_is_reported(self, tmp_path: Path) -> None:
        line, _ = refusal(write(tmp_path, {"text": "a"}, "nope", "{also bad"))
        assert line == 2
