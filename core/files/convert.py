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
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.errors import InvalidDataset
from core.files.validate import parse_json_line

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
                    article = "an" if layout == "alpaca" else "a"
                    raise InvalidDataset(
                        f"line {number}: not {article} {layout} record like line 1 (found keys: "
                        f"{', '.join(sorted(record)) or 'none'}); a file holds one format", line=number)
                out.write(json.dumps({"messages": convert(record, number)}, ensure_ascii=False) + "\n")
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target, layout


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line; a line that is not a JSON object is left for the
    validator's own message (it is skipped here, so detection looks at the first object)."""
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                record = parse_json_line(raw, number)  # depth bounded before parsing, lone surrogates refused
            except ValueError:
                if raw.strip():
                    raise InvalidDataset(f"line {number}: not valid JSON; each line must be one JSON object",
                                         line=number) from None
                continue
            if isinstance(record, dict):
                yield number, record


def _sharegpt(record: dict[str, Any], number: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) and record["system"] else []
    for i, turn in enumerate(record["conversations"]):
        where = f"line {number}: conversations[{i}]"
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise InvalidDataset(f"{where} must be an object with 'from' and a string 'value'", line=number)
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise InvalidDataset(f"{where}: 'from' {turn.get('from')!r} is not one of {', '.join(SHAREGPT_ROLES)}",
                                 line=number)
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _alpaca(record: dict[str, Any], number: int) -> list[dict[str, str]]:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise InvalidDataset(f"line {number}: an Alpaca record needs '{key}' as a string", line=number)
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise InvalidDataset(f"line {number}: Alpaca 'input' must be a string", line=number)
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) and record["system"] else []
    for pair in record.get("history") or []:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise InvalidDataset(f"line {number}: Alpaca 'history' must be a list of [user, assistant] pairs",
                                 line=number)
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = record["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
