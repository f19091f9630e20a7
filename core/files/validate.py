"""Dataset validation at upload: a file is accepted whole or refused at its first bad line.

A dataset is JSONL (UTF-8, one JSON object per line; blank lines are skipped) and every
record has the same one of five formats:

``chat``               {"messages": [{"role": ..., "content": ...}, ...]}; roles system, user,
                       assistant, tool; at least one assistant message with non-empty content
``prompt_completion``  {"prompt": str, "completion": non-empty str}
``text``               {"text": non-empty str}
``preference``         {"input": {"messages": [...]}, "preferred_output": [assistant message, ...],
                       "non_preferred_output": [assistant message, ...]} (OpenAI's DPO format; the
                       input's messages as in chat, without the need for an assistant reply; each
                       output one or more assistant messages with content); trains ``objective: dpo``
``prompts``            {"messages": [...]} or {"prompt": str} with no answer, any other key kept
                       for the graders (``{{item.<key>}}``); a generation job's prompts file
                       (``purpose=generate``) or, uploaded with ``format=prompts``, a training file
                       of ``objective: grpo`` (``validate_prompts``, ``trainer.generate.prompts``)

OpenAI's chat extras are taken as they are: ``tools`` (a list of function definitions), an
assistant's ``tool_calls`` (its ``content`` may then be null; the calls count as its answer) and
``weight`` (0 or 1, assistant messages only; a conversation needs one assistant answer whose
weight is not 0). Other keys in a record (``id``, ``metadata``, a message's ``name``) are
ignored, but a record with the keys of two formats is refused: the trainer could not know
which one was meant. A preference record is recognised by its two output keys (``input`` alone
is too common a name). The names of the formats match ``trainer.config.DATA_FORMATS``; a prompts
file is never detected (an answerless record is a mistake in the other formats), only declared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import InvalidDataset
from core.jsontext import exceeds_depth, lone_surrogate_at, may_hold_surrogate

FORMATS = ("chat", "prompt_completion", "text", "preference", "prompts")
ROLES = ("system", "user", "assistant", "tool")
MAX_LINE_BYTES = 64 << 20
"""A longer line is refused rather than read into memory (64 MiB)."""
MAX_NESTING = 100
"""Arrays and objects nested deeper are refused before parsing (``core.jsontext``); a chat
record with tool schemas nests about ten levels."""

_FORMAT_KEYS = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "preference": ("preferred_output", "non_preferred_output"),
}
_PREFERENCE_KEYS = ("input", "preferred_output", "non_preferred_output")


@dataclass
class DatasetSummary:
    format: str
    num_records: int
    stats: dict[str, Any] = field(default_factory=dict)


def validate_dataset(path: Path) -> DatasetSummary:
    """Read ``path`` once and describe it, or raise ``InvalidDataset`` naming the first bad line."""
    fmt: str | None = None
    first_line = 0
    chars: list[int] = []
    messages = 0
    with path.open("rb") as fh:
        for number, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise InvalidDataset(
                    f"line {number}: longer than {MAX_LINE_BYTES} bytes; split the record", line=number
                )
            record = _parse_line(raw, number)
            if record is None:
                continue
            line_fmt = _format_of(record, number)
            if fmt is None:
                fmt, first_line = line_fmt, number
            elif line_fmt != fmt:
                raise InvalidDataset(
                    f"line {number}: a {line_fmt} record, but line {first_line} is {fmt}; "
                    "a file holds one format, split it into separate files",
                    line=number,
                )
            chars.append(_check_record(record, line_fmt, number))
            if line_fmt == "chat":
                messages += len(record["messages"])
    if fmt is None:
        raise InvalidDataset(
            "the file has no records (it is empty or blank); upload JSONL with one JSON object per line",
            line=1,
        )
    stats: dict[str, Any] = {
        "chars_per_record": {"min": min(chars), "mean": round(sum(chars) / len(chars), 2), "max": max(chars)},
        "total_chars": sum(chars),
    }
    if fmt == "chat":
        stats["messages_per_record_mean"] = round(messages / len(chars), 2)
    return DatasetSummary(format=fmt, num_records=len(chars), stats=stats)


def _parse_line(raw: bytes, number: int) -> dict[str, Any] | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidDataset(
            f"line {number}: not UTF-8 (byte {exc.start}); save the file as UTF-8", line=number
        ) from None
    if not text.strip():
        return None
    try:
        record = parse_json_line(raw, number)
    except json.JSONDecodeError as exc:
        raise InvalidDataset(
            f"line {number}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object",
            line=number,
        ) from None
    except ValueError:  # json refuses an integer of more than 4,300 digits (sys.int_info)
        raise InvalidDataset(
            f"line {number}: a number with more than 4,300 digits; write it as a string", line=number
        ) from None
    if not isinstance(record, dict):
        raise InvalidDataset(
            f"line {number}: a JSON {type(record).__name__}, not an object; each line must be one JSON object",
            line=number,
        )
    return record


def parse_json_line(raw: bytes, number: int) -> Any:
    """The JSON value of line ``number`` (a UTF-8 byte string; line 1 may start with a BOM).

    Its nesting is bounded before it is parsed, and its strings must be text once parsed.

    Raises:
        InvalidDataset: nested more than ``MAX_NESTING`` levels, or a string or key holding an
            unpaired surrogate escape (``"\\ud800"``), naming the line and the field.
        ValueError: not UTF-8, not JSON (``json.JSONDecodeError``), an integer of 4,300+ digits.
    """
    if exceeds_depth(raw, MAX_NESTING):
        raise InvalidDataset(
            f"line {number}: JSON nested too deeply (more than {MAX_NESTING} levels); flatten the record", line=number
        )
    text = raw.decode("utf-8")
    value = json.loads(text.removeprefix("\ufeff") if number == 1 else text)
    if may_hold_surrogate(raw) and (where := lone_surrogate_at(value)) is not None:
        raise InvalidDataset(
            f"line {number}: {where or 'the line'}: an unpaired surrogate escape (\\ud800-\\udfff without "
            "its partner), which is no character; remove it, or write the character itself",
            line=number,
        )
    return value


def _format_of(record: dict[str, Any], number: int) -> str:
    found = [fmt for fmt, keys in _FORMAT_KEYS.items() if any(k in record for k in keys)]
    if not found:
        raise InvalidDataset(
            f"line {number}: no known format; a record needs 'messages' (chat), 'prompt' and "
            f"'completion', 'text', or 'input', 'preferred_output' and 'non_preferred_output' "
            f"(preference) (found keys: {', '.join(sorted(record)) or 'none'})",
            line=number,
        )
    if len(found) > 1:
        raise InvalidDataset(
            f"line {number}: mixes the keys of {' and '.join(found)}; keep the keys of one format",
            line=number,
        )
    return found[0]


def _check_record(record: dict[str, Any], fmt: str, number: int) -> int:
    """Check one record of a known format; return its length in characters."""
    if fmt == "text":
        return len(_nonempty_str(record, "text", number))
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in record:
                raise InvalidDataset(
                    f"line {number}: a prompt/completion record needs both 'prompt' and 'completion'; "
                    f"'{key}' is missing",
                    line=number,
                )
        if not isinstance(record["prompt"], str):
            raise InvalidDataset(f"line {number}: 'prompt' must be a string", line=number)
        return len(record["prompt"]) + len(_nonempty_str(record, "completion", number))
    if fmt == "preference":
        return _check_preference(record, number)
    _check_tools(record, number)
    return _check_messages(record["messages"], number)


def _check_preference(record: dict[str, Any], number: int) -> int:
    """A DPO pair: the prompt's messages and two answers, each all assistant messages with content."""
    for key in _PREFERENCE_KEYS:
        if key not in record:
            raise InvalidDataset(
                f"line {number}: a preference record needs {', '.join(repr(k) for k in _PREFERENCE_KEYS)}; "
                f"'{key}' is missing",
                line=number,
            )
    prompt = record["input"]
    if not isinstance(prompt, dict) or "messages" not in prompt:
        raise InvalidDataset(
            f"line {number}: 'input' must be an object with 'messages' (the conversation before the answers)",
            line=number,
        )
    total = _check_messages(prompt["messages"], number, where="input.messages", needs_answer=False)
    for key in ("preferred_output", "non_preferred_output"):
        total += _check_messages(record[key], number, where=key, roles=("assistant",))
    return total


def _check_messages(
    messages: Any, number: int, *, where: str = "messages", needs_answer: bool = True, roles: tuple[str, ...] = ROLES
) -> int:
    if not isinstance(messages, list) or not messages:
        raise InvalidDataset(f"line {number}: '{where}' must be a non-empty list of messages", line=number)
    total = 0
    has_answer = False
    for i, msg in enumerate(messages):
        at = f"line {number}: {where}[{i}]"
        if not isinstance(msg, dict):
            raise InvalidDataset(f"{at} must be an object with 'role' and 'content'", line=number)
        role = msg.get("role")
        if role is None:
            raise InvalidDataset(f"{at} has no 'role'; use one of {', '.join(roles)}", line=number)
        if role not in roles:
            raise InvalidDataset(f"{at}: role {role!r} is not one of {', '.join(roles)}", line=number)
        content = msg.get("content")
        if content is None and role == "assistant" and msg.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise InvalidDataset(f"{at} needs 'content' as a string", line=number)
        weight = _check_weight(msg, role, at, number)
        total += len(content)
        has_answer = has_answer or (
            role == "assistant" and weight != 0 and (bool(content.strip()) or bool(msg.get("tool_calls")))
        )
    if needs_answer and where != "messages" and not has_answer:
        raise InvalidDataset(
            f"line {number}: '{where}' has no assistant message with content; DPO compares two answers, "
            "each needs one",
            line=number,
        )
    if needs_answer and not has_answer:
        raise InvalidDataset(
            f"line {number}: no assistant message with content (or tool_calls) and a weight other than 0; "
            "the loss is computed on assistant replies, so each conversation needs at least one",
            line=number,
        )
    return total


def _check_weight(msg: dict[str, Any], role: str, at: str, number: int) -> int:
    """OpenAI's ``weight``: 0 (context, not trained) or 1, on assistant messages only."""
    weight = msg.get("weight", 1)
    if "weight" in msg and role != "assistant":
        raise InvalidDataset(f"{at}: 'weight' applies to assistant messages only; remove it", line=number)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise InvalidDataset(f"{at}: 'weight' must be 0 (not trained) or 1, got {weight!r}", line=number)
    return weight


def _check_tools(record: dict[str, Any], number: int) -> None:
    """OpenAI's ``tools``: a list of function definitions, rendered by the model's chat template."""
    tools = record.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InvalidDataset(
            f"line {number}: 'tools' must be a list of objects "
            '({"type": "function", "function": {"name": ..., "parameters": {...}}})',
            line=number,
        )


def _nonempty_str(record: dict[str, Any], key: str, number: int) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise InvalidDataset(f"line {number}: '{key}' must be a string", line=number)
    if not value.strip():
        raise InvalidDataset(f"line {number}: '{key}' is empty; remove the record or fill it", line=number)
    return value


def validate_prompts(path: Path) -> DatasetSummary:
    """A prompts file (``trainer.generate.prompts``: a generation job's, or a GRPO job's training
    file) described, format ``prompts``, or ``InvalidDataset`` naming the first bad line and its field."""
    from trainer.generate.prompts import CHAT, PromptError, read_prompts

    try:
        prompts = read_prompts(path)
    except PromptError as exc:
        raise InvalidDataset(str(exc) + (f" (field {exc.field})" if exc.field and exc.field not in str(exc) else ""),
                             line=exc.line or 1, param="file") from None
    except UnicodeDecodeError as exc:
        raise InvalidDataset(f"the file is not UTF-8 text ({exc.reason} at byte {exc.start})", line=1,
                             param="file") from None
    chat = sum(p.fmt == CHAT for p in prompts)
    chars = [_prompt_chars(p.record) for p in prompts]
    return DatasetSummary(format="prompts", num_records=len(prompts),
                          stats={"chat_prompts": chat, "text_prompts": len(prompts) - chat,
                                 "chars_per_record": {"min": min(chars), "mean": round(sum(chars) / len(chars), 2),
                                                      "max": max(chars)}})


def answerless_prompts(path: Path) -> DatasetSummary | None:
    """``validate_prompts``' summary of a file whose every record asks for an answer (text without a
    completion, chat not ending with the assistant's turn): what a reinforcement file is. None for
    any other file, a valid prompts file included (a chat dataset with a bad line reads as one)."""
    from trainer.generate.prompts import CHAT, read_prompts

    try:
        summary = validate_prompts(path)
    except InvalidDataset:
        return None
    for prompt in read_prompts(path):
        record = prompt.record
        if "completion" in record or (prompt.fmt == CHAT and record["messages"][-1].get("role") == "assistant"):
            return None
    return summary


def _prompt_chars(record: dict[str, Any]) -> int:
    """Characters of a prompt's text (a chat prompt's string contents)."""
    if "prompt" in record:
        return len(record["prompt"])
    return sum(len(m["content"]) for m in record["messages"] if isinstance(m.get("content"), str))
