"""Two common dataset layouts that are not ftq's, converted to chat ``messages`` at upload.

    ShareGPT  {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}],
               "system"?: str}
    Alpaca    {"instruction": str, "input"?: str, "output": str, "system"?: str,
               "history"?: [[user, assistant], ...]}

The layout is detected from the first record (a record with ftq's own keys is never converted)
and every record must then have it; the file is rewritten as chat JSONL, which
``core.files.validate`` checks as any chat file, and the upload's ``stats.converted_from`` states
what was done. Mapping: ShareGPT ``from`` human/user → user, gpt/assistant/chatgpt/model/bard →
assistant, system → system, tool/function/observation/function_response → tool (unknown values
are refused, naming the line); Alpaca's instruction and input (when not empty) joined by a blank
line are the user turn, output the assistant's, history's pairs come first.

Strict: every field a converter reads has its type or is refused naming the line and the field
(``system`` as a number, ``input`` as ``false``: a 422, never dropped); an optional field may be
absent or null. Lines are read with the native line cap (``core.files.validate.MAX_LINE_BYTES``)
applied while reading: a longer line is refused before it is parsed, its bytes never held whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.errors import InvalidDataset
from core.files import validate

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant", "bard": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
}
_NATIVE_KEYS = ("messages", "prompt", "completion", "text", "preferred_output", "non_preferred_output")


def detect(record: dict[str, Any]) -> str | None:
    """``sharegpt``, ``alpaca`` or None (ftq's own formats, or unknown: the validator says which)."""
    if any(key in record for key in _NATIVE_KEYS):
        return None
    if isinstance(record.get("conversations"), list):
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return None


def convert_to_chat(path: Path, layout: str | None = None) -> tuple[Path, str] | None:
    """Rewrite a ShareGPT or Alpaca file at ``path`` as chat JSONL beside it.

    ``layout`` None detects it from the first record; ``"sharegpt"`` / ``"alpaca"`` (the upload's
    explicit ``format``) requires it of every record. Returns ``(new path, layout)``, or None when
    nothing is to convert (the file is then validated as it is). Raises InvalidDataset naming the
    first record that does not convert.
    """
    if layout is None:
        first = next((record for _, record in _records(path)), None)
        layout = detect(first) if first is not None else None
    if layout is None:
        return None
    convert: Callable[[dict[str, Any], int], list[dict[str, str]]] = _sharegpt if layout == "sharegpt" else _alpaca
    target = path.with_name(path.name + ".chat.jsonl")
    try:
        with target.open("w", encoding="utf-8") as out:
            for number, record in _records(path):
                if detect(record) != layout:
                    raise _not_layout(record, layout, number)
                out.write(json.dumps({"messages": convert(record, number)}, ensure_ascii=False) + "\n")
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target, layout


def _not_layout(record: dict[str, Any], layout: str, number: int) -> InvalidDataset:
    if layout == "sharegpt" and "conversations" in record and not any(key in record for key in _NATIVE_KEYS):
        return InvalidDataset(f"line {number}: 'conversations' must be a list of {{from, value}} objects, not "
                              f"{_kind(record['conversations'])}", line=number)
    article = "an" if layout == "alpaca" else "a"
    return InvalidDataset(f"line {number}: not {article} {layout} record like line 1 (found keys: "
                          f"{', '.join(sorted(record)) or 'none'}); a file holds one format", line=number)


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line; a line that is not a JSON object is left for the
    validator's own message (it is skipped here, so detection looks at the first object). A line
    over the cap is refused once ``cap + 1`` bytes of it are read."""
    cap = validate.MAX_LINE_BYTES
    with path.open("rb") as fh:
        for number, raw in enumerate(iter(lambda: fh.readline(cap + 1), b""), start=1):
            if len(raw) > cap:
                raise InvalidDataset(f"line {number}: longer than {cap} bytes; split the record", line=number)
            try:
                record = validate.parse_json_line(raw, number)  # depth bounded before parsing, lone surrogates refused
            except ValueError:
                if raw.strip():
                    raise InvalidDataset(f"line {number}: not valid JSON; each line must be one JSON object",
                                         line=number) from None
                continue
            if isinstance(record, dict):
                yield number, record


def _sharegpt(record: dict[str, Any], number: int) -> list[dict[str, str]]:
    messages = _system(record, number)
    for i, turn in enumerate(record["conversations"]):
        where = f"line {number}: conversations[{i}]"
        if not isinstance(turn, dict):
            raise InvalidDataset(f"{where} must be an object with a string 'from' and 'value', not {_kind(turn)}",
                                 line=number)
        for key in ("from", "value"):
            if not isinstance(turn.get(key), str):
                raise InvalidDataset(f"{where}.{key} must be a string, not {_kind(turn.get(key))}", line=number)
        role = SHAREGPT_ROLES.get(turn["from"].lower())
        if role is None:
            raise InvalidDataset(f"{where}: 'from' {turn['from']!r} is not one of {', '.join(SHAREGPT_ROLES)}",
                                 line=number)
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _alpaca(record: dict[str, Any], number: int) -> list[dict[str, str]]:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise InvalidDataset(f"line {number}: an Alpaca record needs '{key}' as a string, not "
                                 f"{_kind(record.get(key))}", line=number)
    extra = _optional(record, "input", str, "a string", number) or ""
    messages = _system(record, number)
    history = _optional(record, "history", list, "a list of [user, assistant] pairs", number) or []
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise InvalidDataset(f"line {number}: history[{i}] must be a [user, assistant] pair of strings, not "
                                 f"{_kind(pair) if not isinstance(pair, list) else json.dumps(pair)[:80]}", line=number)
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = record["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def _system(record: dict[str, Any], number: int) -> list[dict[str, str]]:
    system = _optional(record, "system", str, "a string", number)
    return [{"role": "system", "content": system}] if system else []


def _optional(record: dict[str, Any], key: str, kind: type, described: str, number: int) -> Any:
    """``record[key]``, None when absent or null; InvalidDataset naming the field when of another type."""
    value = record.get(key)
    if value is not None and not isinstance(value, kind):
        raise InvalidDataset(f"line {number}: '{key}' must be {described} (or absent), not {_kind(value)}",
                             line=number)
    return value


def _kind(value: Any) -> str:
    """``value``'s JSON type, as a user reads it: ``a number (0)``, ``a boolean (false)``, ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, (int, float)):
        return f"a number ({json.dumps(value)[:40]})"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, dict) else "an array"
