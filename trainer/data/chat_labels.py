"""Which characters of a rendered conversation carry loss, found with one rendering of the record.

The definition (``trainer.data.dataset``): assistant turn i is labelled from the end of the rendering of
``messages[:i]`` with the generation prompt (where the answer starts) to the end of the rendering
of ``messages[:i+1]`` (where it ends, eos included; the whole text for the last message), when
both renderings are prefixes of the whole conversation's; a turn where they are not (the template
renders a last turn differently, e.g. Qwen3's empty think block) is left unlabelled. Rendering
every prefix costs the square of the turns (1,000 turns 5.6 s, 4,000 turns 106 s).

``assistant_spans`` finds the same spans from the whole rendering ``text``:

1. Probes learn what the template writes around one message when it is the last one: the
   message with its content replaced by a sentinel, after a short context (the record's messages
   before the first of that role, contents replaced by sentinels too), rendered with and without
   the generation prompt. That gives, per message shape (role and every key but the content),
   the *tail* after the content and, for an answer, the *lead* between the generation prompt and
   the content.
2. Walking ``text`` once: an answer starts where the message before it ends with its content and
   its tail with the generation prompt (searched from the previous answer on), and ends after its
   lead, its content (as written, or trimmed, as templates that ``trim`` print it) and its tail.
   Where the template wrote something else than the probe's lead or tail around an answer whose
   content is in place, the turn is unlabelled, as the definition leaves it.
3. The definition itself checks the result by rendering an answer's two prefixes (no
   tokenizing): the first and the last answer the walk placed in each situation an answer can be
   rendered differently in (the message before it, a user turn before it or not, tool calls, an
   empty content), and every answer it could not place (a content the template rewrote, an empty
   message before an answer). A check that disagrees with the walk (a template whose rendering of
   a turn depends on later messages, as one placing a block before the last user turn), or more
   than ``MAX_CHECKED_TURNS`` unplaced answers, makes the whole record located per turn, which is
   allowed for at most ``PER_TURN_MAX_TURNS`` answers and is a ``DatasetError`` beyond.

Renders: 1 + up to 3 per distinct message shape (small) + 2 per checked answer (usually 2).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from trainer.errors import DatasetError

Render = Callable[[list[dict[str, Any]], bool], str]
"""``render(messages, add_generation_prompt) -> text``: the tokenizer's chat template."""
Span = tuple[int, int]

MAX_CHECKED_TURNS = 8
"""Unplaced answers located per turn before the whole record is (the first and last answer of
each situation are checked beside them)."""
PER_TURN_MAX_TURNS = 64
"""Answers a record may have when its template can only be followed per turn (two renderings of
a prefix each: 64 answers of a long record is about a second; 4,000 were 106 s)."""
_SENTINEL = "\ue000ftq-{}\ue001"
"""Private-use characters: no template trims them, no tokenizer matters (probes are never tokenized)."""


def assistant_spans(messages: list[dict[str, Any]], turns: list[int], render: Render, text: str) -> dict[int, Span]:
    """The character spans ``[start, end)`` of ``text`` (``render(messages, False)``) to label,
    by index of the assistant message, for the assistant messages ``turns`` (those trained on);
    a turn left unlabelled has no entry.

    Raises:
        DatasetError: the template can only be followed per turn and the record has more than
            ``PER_TURN_MAX_TURNS`` answers.
    """
    if not turns:
        return {}
    found = _walk(messages, render, text)
    if found is None:
        return _all_per_turn(messages, turns, render, text)
    unplaced = [i for i in turns if found[i] is _UNPLACED]
    placed = [i for i in turns if found[i] is not _UNPLACED]
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), len(messages))
    firsts: dict[tuple[Any, ...], int] = {}
    lasts: dict[tuple[Any, ...], int] = {}
    for i in placed:
        situation = _situation(messages, i, first_user)
        firsts.setdefault(situation, i)
        lasts[situation] = i
    for i in sorted({*firsts.values(), *lasts.values(), *unplaced}):  # at most 2 x 34 + 8
        reference = span_per_turn(messages, i, render, text)
        if found[i] is not _UNPLACED and found[i] != reference:
            return _all_per_turn(messages, turns, render, text)
        found[i] = reference
    return {i: span for i in turns if isinstance(span := found[i], tuple)}


def _situation(messages: list[dict[str, Any]], i: int, first_user: int) -> tuple[Any, ...]:
    """What a template may render an answer differently by: the message before it, whether a user
    turn came before (Qwen3 thinks only after one), whether it calls tools or says nothing."""
    answer = messages[i]
    return (messages[i - 1]["role"] if i else None, first_user < i, bool(answer.get("tool_calls")), bool(_content(answer)))


def span_per_turn(messages: list[dict[str, Any]], i: int, render: Render, text: str) -> Span | None:
    """Answer ``i``'s span by the definition: its two prefixes rendered; None when either is not
    a prefix of ``text``."""
    start = render(messages[:i], True)
    if not text.startswith(start):
        return None
    if i == len(messages) - 1:
        return len(start), len(text)
    end = render(messages[: i + 1], False)
    return (len(start), len(end)) if text.startswith(end) else None


def _all_per_turn(messages: list[dict[str, Any]], turns: list[int], render: Render, text: str) -> dict[int, Span]:
    if len(turns) > PER_TURN_MAX_TURNS:
        raise DatasetError(
            f"the model's chat template renders this conversation's turns differently once later messages "
            f"follow, so its answers can only be found one prefix at a time, which is allowed for at most "
            f"{PER_TURN_MAX_TURNS} assistant turns (this record has {len(turns)}); split the conversation")
    spans = {i: span_per_turn(messages, i, render, text) for i in turns}
    return {i: span for i, span in spans.items() if span is not None}


def _walk(messages: list[dict[str, Any]], render: Render, text: str) -> dict[int, Any] | None:
    """Every answer located in order (untrained ones too, so the search moves past them); None
    once more than ``MAX_CHECKED_TURNS`` answers are unplaced (each may have searched to the end)."""
    walk, found, unplaced = _Walk(messages, render, text), {}, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        found[i] = walk.locate(i)
        unplaced += found[i] is _UNPLACED
        if unplaced > MAX_CHECKED_TURNS:
            return None
    return found


class _Unplaced:
    """The walk could not place this answer (the definition decides)."""


_UNPLACED = _Unplaced()


class _Walk:
    """One pass over ``text``, answer by answer (``locate`` is called in order)."""

    def __init__(self, messages: list[dict[str, Any]], render: Render, text: str) -> None:
        self.messages, self.text, self.cursor = messages, text, 0
        self.probes = _Probes(messages, render)

    def locate(self, i: int) -> Span | None | _Unplaced:
        start = self._answer_start(i)
        if start is None:
            return _UNPLACED
        self.cursor = start
        if i == len(self.messages) - 1:
            return start, len(self.text)
        shape = self.probes.answer(i)
        if shape is None:
            return _UNPLACED
        lead, tail = shape
        content = _content(self.messages[i])
        if not content:  # the probe rendered the real, empty message: lead is all of it
            end = start + len(lead)
            return (start, end) if self.text.startswith(lead, start) else None
        if not self.text.startswith(lead, start):
            return None if _variant_at(self.text, content, start) is not None else _UNPLACED
        at = start + len(lead)
        written = [v for v in _variants(content) if self.text.startswith(v, at)]
        if not written:
            return _UNPLACED
        for variant in written:  # 'a ' as written may be 'a' trimmed followed by the template's ' '
            end = at + len(variant) + len(tail)
            if self.text.startswith(tail, at + len(variant)):
                self.cursor = end
                return start, end
        self.cursor = at + len(written[0])
        return None

    def _answer_start(self, i: int) -> int | None:
        if i == 0:
            return self.probes.empty_generation_prompt(self.text)
        before = _content(self.messages[i - 1])
        tail = self.probes.tail(i - 1)
        if not before or tail is None:
            return None
        for written in _variants(before):
            at = self.text.find(written + tail, self.cursor)
            if at >= 0:
                return at + len(written) + len(tail)
        return None


class _Probes:
    """What the template writes around one message as the last, per message shape (cached)."""

    def __init__(self, messages: list[dict[str, Any]], render: Render) -> None:
        self.messages, self.render = messages, render
        self.skeleton = [_sentinelled(m, _SENTINEL.format(k)) for k, m in enumerate(messages)]
        self.first_of_role: dict[str, int] = {}
        for k, m in enumerate(messages):
            self.first_of_role.setdefault(m["role"], k)
        self.cache: dict[tuple[str, ...], Any] = {}

    def tail(self, k: int) -> str | None:
        """What follows message ``k``'s content when it is last and the generation prompt follows."""
        found = self._probe(k, "tail")
        return found[1] if found is not None else None

    def answer(self, k: int) -> tuple[str, str] | None:
        """Answer ``k`` as last: (lead from the generation prompt's end to the content, tail after
        it); with an empty content, (all of it, "")."""
        return self._probe(k, "answer")

    def empty_generation_prompt(self, text: str) -> int | None:
        try:
            prompt = self.render([], True)
        except Exception:  # noqa: BLE001 - a template that cannot render no messages
            return None
        return len(prompt) if text.startswith(prompt) else None

    def _probe(self, k: int, kind: str) -> tuple[str, str] | None:
        message = self.messages[k]
        key = (kind, _shape(message))
        if key not in self.cache:
            try:
                self.cache[key] = self._render_probe(message, kind)
            except Exception:  # noqa: BLE001 - a template that refuses the probe: the definition decides
                self.cache[key] = None
        return self.cache[key]

    def _render_probe(self, message: dict[str, Any], kind: str) -> tuple[str, str] | None:
        context = self.skeleton[: self.first_of_role[message["role"]]]
        sentinel = _SENTINEL.format("probe")
        probe = _sentinelled(message, sentinel)
        whole = self.render([*context, probe], kind == "tail")
        if kind == "tail":
            return ("", whole.split(sentinel, 1)[1]) if whole.count(sentinel) == 1 else None
        prompt = self.render(context, True)
        if not whole.startswith(prompt):
            return None
        rest = whole[len(prompt):]
        if probe["content"] != sentinel:
            return rest, ""
        if rest.count(sentinel) != 1:
            return None
        lead, tail = rest.split(sentinel)
        return lead, tail


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) and content.strip() else ""


def _sentinelled(message: dict[str, Any], sentinel: str) -> dict[str, Any]:
    return {**message, "content": sentinel} if _content(message) else message


def _shape(message: dict[str, Any]) -> tuple[str, ...]:
    rest = {k: v for k, v in message.items() if k != "content"}
    return (json.dumps(rest, sort_keys=True, default=str), "text" if _content(message) else repr(message.get("content")))


def _variants(content: str) -> list[str]:
    """How a template may print ``content``: as written, or trimmed (Jinja's ``trim``)."""
    out = [content]
    for variant in (content.strip(), content.rstrip(), content.lstrip()):
        if variant not in out:
            out.append(variant)
    return out


def _variant_at(text: str, content: str, at: int) -> str | None:
    return next((v for v in _variants(content) if text.startswith(v, at)), None)
