"""A session's deltas in OpenAI's shapes: ``chat.completion`` and its ``chat.completion.chunk``s,
``text_completion`` (whole and streamed), logprobs, ``usage``; the stream as Server-Sent Events
ending with ``data: [DONE]``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from core.errors import FtqError

FINISH = {"stop": "stop", "length": "length"}
"""The sampler's finish reasons in OpenAI's words (a cancelled choice, which only a stopping
session makes, reads ``stop``)."""


@dataclass
class Answer:
    """One request's answer as its deltas arrive."""

    request_id: str
    model: str
    chat: bool
    prompt_tokens: int
    n: int
    created: int = field(default_factory=lambda: int(time.time()))
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, delta: dict[str, Any]) -> None:
        choice = int(delta["choice"])
        self.texts.setdefault(choice, []).append(delta.get("text", ""))
        self.completion_tokens += len(delta.get("token_ids") or [])
        if delta.get("logprobs") is not None:
            self.logprobs.setdefault(choice, []).extend(delta["logprobs"])
        if delta.get("finish_reason") is not None:
            self.finish[choice] = FINISH.get(delta["finish_reason"], "stop")

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def whole(self) -> dict[str, Any]:
        choices = []
        for i in range(self.n):
            text, lps = "".join(self.texts.get(i, [])), self.logprobs.get(i)
            choice: dict[str, Any] = {"index": i, "finish_reason": self.finish.get(i, "stop"),
                                      "logprobs": _logprobs(lps, self.chat) if lps is not None else None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._head(chunk=False), "choices": choices, "usage": self.usage}

    def chunk(self, delta: dict[str, Any], first: bool) -> dict[str, Any]:
        """The chunk for one delta (already ``add``-ed)."""
        lps = delta.get("logprobs")
        choice: dict[str, Any] = {"index": int(delta["choice"]),
                                  "finish_reason": FINISH.get(delta["finish_reason"], "stop")
                                  if delta.get("finish_reason") is not None else None,
                                  "logprobs": _logprobs(lps, self.chat) if lps is not None else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta.get("text", "")} if first else {
                "content": delta.get("text", "")}
        else:
            choice["text"] = delta.get("text", "")
        return {**self._head(chunk=True), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage}

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id if self.chat else self.request_id.replace("chatcmpl", "cmpl", 1),
                "object": kind, "created": self.created, "model": self.model, "system_fingerprint": "ftq"}


def sse(answer: Answer, deltas: Iterable[dict[str, Any]], include_usage: bool) -> Iterator[bytes]:
    """The stream: a chunk per delta, the usage chunk when asked, ``[DONE]``; an error mid-stream
    is one ``data: {"error": ...}`` (the official client raises it) and ends the stream."""
    started: set[int] = set()
    try:
        for delta in deltas:
            answer.add(delta)
            choice = int(delta["choice"])
            yield _event(answer.chunk(delta, first=choice not in started))
            started.add(choice)
    except FtqError as exc:
        yield _event({"error": {"message": exc.message, "type": "server_error", "param": exc.param,
                                "code": exc.code}})
        return
    if include_usage:
        yield _event(answer.usage_chunk())
    yield b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def _logprobs(entries: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    if chat:
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                              for t, lp in e.get("top", [])]} for e in entries], "refusal": None}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for t, lp in e.get("top", [])} for e in entries], "text_offset": offsets}
