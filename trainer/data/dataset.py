"""Read JSONL training records and turn them into token ids with a loss mask.

Three record formats, one per file (``auto`` detects it from the first record):

- chat: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the tokenizer's
  chat template; loss only on the tokens each assistant turn adds. OpenAI's chat JSONL is taken
  as it is: an assistant message with ``"weight": 0`` is context, not trained; ``tools`` (a
  record's function definitions) and an assistant's ``tool_calls`` (its ``content`` may then be
  null) go to the template, the calls' JSON-string ``arguments`` parsed into the dict that
  transformers' templates expect.
- prompt/completion: ``{"prompt": ..., "completion": ...}``; loss only on the completion (+ eos).
- text: ``{"text": ...}``; loss on every token (+ eos).

Labels use -100 for "no loss" (the ignore index of ``torch.nn.functional.cross_entropy``).

Finding assistant tokens without generation markers: for assistant turn i, the rendering of
``messages[:i]`` with the generation prompt ends where the answer starts and that of
``messages[:i+1]`` where it ends (eos included); that span of the full rendering is labelled.
That needs the template to render a conversation's prefix as a prefix of the whole; a turn where
it does not (some templates rewrite earlier turns, e.g. dropping reasoning) is left unlabelled
rather than guessed, and a record with no locatable assistant tokens is an error naming its line.
The spans are found from one rendering and one tokenization of the record
(``trainer.chat_labels``, character spans mapped to tokens by the fast tokenizer's offsets), so a
record costs time in proportion to its length, not to the square of its turns; a tokenizer
without offsets (a slow, Python one) renders and tokenizes each prefix, for at most
``PER_TURN_MAX_TURNS`` answers a record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.chat_labels import PER_TURN_MAX_TURNS, assistant_spans
from trainer.errors import DatasetError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Sample:
    """One tokenized record: ``input_ids`` and ``labels`` of equal length (-100 = no loss)."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


def read_records(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """Parse a JSONL file into ``(line_number, record)`` pairs; blank lines are skipped.

    Raises:
        DatasetError: the file is missing, empty, or a line is not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{path}, line {number}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(record, dict):
                raise DatasetError(
                    f"{path}, line {number}: expected a JSON object, got {type(record).__name__}"
                )
            records.append((number, record))
    if not records:
        raise DatasetError(
            f"{path}: the file has no records; write one JSON object per line"
        )
    return records


def detect_format(record: dict[str, Any]) -> str | None:
    """``chat``, ``prompt_completion`` or ``text`` from a record's keys; None if it matches none."""
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def validate_record(record: dict[str, Any], fmt: str) -> str | None:
    """The reason ``record`` is not a valid ``fmt`` record, or None when it is."""
    found = detect_format(record)
    if found != fmt:
        return f"expected a {fmt} record, found {found or 'none of messages / prompt+completion / text'}"
    if fmt == "chat":
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(messages):
            problem = _message_problem(m)
            if problem:
                return f"messages[{i}]{problem}"
        if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
            return (
                "no assistant message to train on (every one is missing or has weight 0): "
                "there is nothing to learn from this conversation"
            )
        return None
    keys = ("prompt", "completion") if fmt == "prompt_completion" else ("text",)
    for key in keys:
        if not isinstance(record[key], str):
            return f"'{key}' must be a string"
    if not record[keys[-1]]:
        return f"'{keys[-1]}' is empty"
    return None


def _message_problem(m: Any) -> str | None:
    """What is wrong with one chat message (to follow ``messages[i]``), or None."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return " must be an object with string 'role' and 'content'"
    if m["role"] not in ROLES:
        return f".role {m['role']!r} is not one of {', '.join(ROLES)}"
    calls_only = m["role"] == "assistant" and m.get("content") is None and m.get("tool_calls")
    if not isinstance(m.get("content"), str) and not calls_only:
        return " must be an object with string 'role' and 'content' (null only beside tool_calls)"
    if "weight" in m and (m["role"] != "assistant" or m["weight"] not in (0, 1)):
        return ".weight must be 0 or 1, on an assistant message"
    return None


def load_samples(
    path: str | Path, tokenizer: Any, fmt: str = "auto", max_seq_len: int = 4096
) -> list[Sample]:
    """Read, validate and tokenize a JSONL file; samples are truncated to ``max_seq_len`` tokens.

    Samples left with no loss token after truncation (a prompt longer than ``max_seq_len``) are
    dropped; if that drops all of them the file cannot train anything and is an error.

    Raises:
        DatasetError: naming the line and the problem.
    """
    records = read_records(path)
    if fmt == "auto":
        fmt = detect_format(records[0][1]) or ""
        if not fmt:
            raise DatasetError(
                f"{path}, line {records[0][0]}: cannot tell the format; use 'messages', 'prompt'+'completion' or 'text'"
            )
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"{path}: chat records need a tokenizer with a chat template; this tokenizer has none"
        )
    samples = []
    for number, record in records:
        problem = validate_record(record, fmt)
        if problem:
            raise DatasetError(f"{path}, line {number}: {problem}")
        try:
            sample = tokenize_record(record, fmt, tokenizer)
        except DatasetError as exc:
            raise DatasetError(f"{path}, line {number}: {exc}") from None
        if fmt == "chat" and sample.num_loss_tokens == 0:
            raise DatasetError(
                f"{path}, line {number}: the chat template does not render this conversation's prefixes as "
                "prefixes of the whole, so no assistant tokens could be located"
            )
        sample = Sample(sample.input_ids[:max_seq_len], sample.labels[:max_seq_len])
        if sample.num_loss_tokens > 0:
            samples.append(sample)
    if not samples:
        raise DatasetError(
            f"{path}: every record has its trainable tokens beyond max_seq_len={max_seq_len}; raise data.max_seq_len"
        )
    return samples


def tokenize_record(record: dict[str, Any], fmt: str, tokenizer: Any) -> Sample:
    """Tokenize one validated record of format ``fmt`` (no truncation)."""
    if fmt == "chat":
        return _tokenize_chat(record["messages"], tokenizer, tools=record.get("tools"))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if fmt == "prompt_completion":
        prompt = tokenizer(record["prompt"])["input_ids"]
        completion = (
            tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos
        )
        return Sample(prompt + completion, [IGNORE_INDEX] * len(prompt) + completion)
    ids = tokenizer(record["text"])["input_ids"] + eos
    return Sample(ids, list(ids))


def _tokenize_chat(
    messages: list[dict[str, Any]], tokenizer: Any, tools: list[dict[str, Any]] | None = None
) -> Sample:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0]
    messages = [template_message(message) for message in messages]

    def render(conversation: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            conversation, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    text = render(messages, False)
    if not getattr(tokenizer, "is_fast", False):
        return _tokenize_chat_per_turn(messages, turns, tokenizer, render, text)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    boundaries = _token_boundaries(encoded["offset_mapping"], len(text))
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in assistant_spans(messages, turns, render, text).values():
        if start in boundaries and end in boundaries:  # else the prefixes' tokens are not the whole's
            first, last = boundaries[start], boundaries[end]
            labels[first:last] = ids[first:last]
    return Sample(ids, labels)


def _token_boundaries(offsets: list[tuple[int, int]], length: int) -> dict[int, int]:
    """Character position -> index of the first token after it, for the positions between two
    tokens (and the text's ends); a position inside a token is no boundary. Where offsets leave a
    gap (byte-level tokenizers with ``trim_offsets`` drop a token's leading space from its offsets)
    the gap belongs to the next token: the boundary is where the previous one ends."""
    boundaries = {0: 0, length: len(offsets)}
    for k in range(1, len(offsets)):
        if offsets[k - 1][1] <= offsets[k][0]:
            boundaries.setdefault(offsets[k - 1][1], k)
    return boundaries


def _tokenize_chat_per_turn(
    messages: list[dict[str, Any]], turns: list[int], tokenizer: Any, render: Any, text: str
) -> Sample:
    """The definition followed literally, for tokenizers without character offsets: each
    answer's two prefixes rendered and tokenized (the square of the turns; bounded)."""
    if len(turns) > PER_TURN_MAX_TURNS:
        raise DatasetError(
            f"this tokenizer gives no character offsets (a slow tokenizer), so each answer's prefix is "
            f"tokenized on its own, which is allowed for at most {PER_TURN_MAX_TURNS} assistant turns a "
            f"record (this one has {len(turns)}); split the conversation, or give the model a fast tokenizer"
        )

    def encode(conversation: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        return tokenizer(render(conversation, generation_prompt), add_special_tokens=False)["input_ids"]

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    for i in turns:
        start_ids = encode(messages[:i], True)
        end_ids = ids if i == len(messages) - 1 else encode(messages[: i + 1], False)
        if ids[: len(start_ids)] != start_ids or ids[: len(end_ids)] != end_ids:
            continue  # the template rewrites this prefix; leave the turn unlabelled rather than guess
        labels[len(start_ids) : len(end_ids)] = ids[len(start_ids) : len(end_ids)]
    return Sample(ids, labels)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: no ``weight`` (ours, not the template's), content
    ``""`` rather than null beside ``tool_calls``, each call's JSON-string ``arguments`` as a dict."""
    out = {k: v for k, v in message.items() if k != "weight"}
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_parsed_call(call) for call in out["tool_calls"]]
    return out


def _parsed_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}
