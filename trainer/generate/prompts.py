"""A generation job's prompts file: one JSON object per line, chat or text (standard library only:
the API preflights an upload with it, the trainer reads the file with it).

    chat   {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}
           (optionally "tools"): the model answers the next assistant turn, through its chat template
    text   {"prompt": "..."}: continued as it is (the tokenizer's bos added as in training)

Blank lines are skipped; a line's number is its 1-based line in the file. Any other key is kept
on the record (an ``id`` to join the output on, say) and echoed nowhere but the job's own output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHAT, TEXT = "chat", "text"
ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_PROMPTS = 1_000_000


class PromptError(ValueError):
    """A prompts file that cannot be generated from; the message names the line and the field."""

    def __init__(self, message: str, line: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.line, self.field = line, field


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of the file."""

    index: int
    """0-based position among the file's prompts (the output's order)."""
    line: int
    fmt: str
    """``CHAT`` or ``TEXT``."""
    record: dict[str, Any]


def read_prompts(path: str | Path, *, limit: int = MAX_PROMPTS) -> list[PromptRecord]:
    """Every prompt of the file at ``path``, in order.

    Raises:
        PromptError: a line is not a JSON object, has neither or both of ``messages`` and
            ``prompt``, or a bad message; no prompt at all; more than ``limit``.
    """
    prompts: list[PromptRecord] = []
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            if len(prompts) >= limit:
                raise PromptError(f"more than {limit} prompts; split the file", line=number)
            prompts.append(parse_line(raw, number, len(prompts)))
    if not prompts:
        raise PromptError("the file holds no prompt: one JSON object per line, "
                          '{"messages": [...]} or {"prompt": "..."}')
    return prompts


def parse_line(raw: str, number: int, index: int) -> PromptRecord:
    """One line as a prompt (see ``read_prompts``)."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PromptError(f"line {number}: not JSON ({exc.msg} at column {exc.colno})", line=number) from None
    if not isinstance(record, dict):
        raise PromptError(f"line {number}: a JSON object is expected, got {type(record).__name__}", line=number)
    has_chat, has_text = "messages" in record, "prompt" in record
    if has_chat == has_text:
        which = "both" if has_chat else "neither"
        raise PromptError(f'line {number}: has {which} of "messages" and "prompt"; give one: {{"messages": '
                          '[{"role": "user", "content": "..."}]} or {"prompt": "..."}', line=number,
                          field="messages" if has_chat else "prompt")
    if has_text:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise PromptError(f'line {number}: "prompt" must be a non-empty string', line=number, field="prompt")
        return PromptRecord(index, number, TEXT, record)
    _check_messages(record["messages"], number)
    return PromptRecord(index, number, CHAT, record)


def _check_messages(messages: Any, number: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise PromptError(f'line {number}: "messages" must be a non-empty list', line=number, field="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise PromptError(f"line {number}: {where} must be an object", line=number, field=where)
        if message.get("role") not in ROLES:
            raise PromptError(f"line {number}: {where}.role must be one of {', '.join(ROLES)}, got "
                              f"{message.get('role')!r}", line=number, field=f"{where}.role")
        content = message.get("content")
        if not isinstance(content, (str, list)) and not (content is None and message.get("tool_calls")):
            raise PromptError(f"line {number}: {where}.content must be a string or a list of text parts",
                              line=number, field=f"{where}.content")
