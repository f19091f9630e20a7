"""Limits every request's input must respect before a route runs, because the store cannot hold
what lies beyond them and would answer a 500 instead of a 4xx naming the field.

* Text: PostgreSQL refuses the NUL character (``\\x00``) in ``text`` and ``jsonb`` values, and
  no id, name or filter means anything with a control character in it. So a control character
  (U+0000-U+001F, U+007F) in a path parameter, a query parameter (name or value), a key of a
  JSON body or a multipart field is a 4xx that names where it is (``job_id``, ``after``,
  ``metadata.note``, ``purpose``); in a JSON body's string values tab, newline and carriage
  return stay legal (free text such as ``sample_prompts``), the others do not. An unpaired
  surrogate (``"\\ud800"``), valid JSON but no text the store can encode, is refused the same way.
* Depth and encoding: a JSON body nested more than ``MAX_BODY_DEPTH`` levels, or not UTF-8, is
  refused before anything parses it (``BoundedJsonBodies``), since the parser and everything that
  walks the value after it recurse once per level.
* Integers: ``INT32_MAX`` / ``INT64_MAX`` bound the query and path integers that meet an
  ``integer`` / ``bigint`` column (``after_step``, a checkpoint's ``step``, ``max_running_jobs``,
  an event ``seq``); routes and schemas declare them with ``le=``.

``check_request_text`` is a dependency of both apps (``api.app.create_app``, and
``api.openai.app`` whose errors take OpenAI's shape); ``check_field`` is what the streaming
multipart reader (``api.files.upload``) calls per field. Neither reads a body a route streams.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body
from api.openai.errors import OPENAI_PATH, openai_error
from core.errors import InvalidInput
from core.jsontext import exceeds_depth, lone_surrogate_at, may_hold_surrogate

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_BODY_DEPTH = 32
"""A job spec nests five levels; OpenAI's ``method.dpo.hyperparameters`` four."""
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
TEXT_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""In free text: every control character but tab, newline and carriage return."""
UNKNOWN_WHEN_MALFORMED = frozenset({"export_id"})
"""Path ids whose routes check the id's shape before the store and answer any malformed one as
the unknown id it is (404, ``api.jobs.exports``), control characters included."""
_ESCAPED_CONTROL = re.compile(rb"\\u00[01][0-9a-fA-F]|\\u007[fF]|\x7f")


async def check_request_text(request: Request) -> None:
    """Refuse control characters and unpaired surrogates in what the store would meet (module docstring)."""
    for name, value in request.path_params.items():
        if isinstance(value, str) and name not in UNKNOWN_WHEN_MALFORMED:
            check_field(value, name)
    for name, value in request.query_params.multi_items():
        check_field(name, name)
        check_field(value, name)
    body: bytes | None = getattr(request, "_body", None)
    if body and _is_json(request.headers.get("content-type", "")) and (
        _ESCAPED_CONTROL.search(body) or may_hold_surrogate(body)
    ):
        try:
            document = json.loads(body)
        except (ValueError, RecursionError):
            return  # the route's own parsing refuses it
        for path, kind in _bad_text(document, ""):
            raise _text_error(path or "body", kind, param=path or None)


def check_field(value: str, name: str) -> None:
    """Refuse a control character or an unpaired surrogate in an id, a name or a form field ``name``."""
    if CONTROL.search(value):
        raise _text_error(name, "control", param=name)
    if lone_surrogate_at(value) is not None:
        raise _text_error(name, "surrogate", param=name)


class BoundedJsonBodies:
    """ASGI middleware: a JSON body nested more than ``MAX_BODY_DEPTH`` levels, or not UTF-8, is a
    422 (400 in OpenAI's shape under ``/openai/``) before any parser sees it. Other bodies pass
    untouched; a JSON body is read whole first, as the route would read it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_json(_header(scope, b"content-type")):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        message: Message = {"type": "http.request", "more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay(b"".join(chunks), message, receive), send)
                return
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        problem = _body_problem(body)
        if problem is not None:
            await _refusal(scope["path"], problem)(scope, receive, send)
            return
        await self.app(scope, _replay(body, None, receive), send)


def _body_problem(body: bytes) -> str | None:
    """What makes a JSON body unreadable before any parser runs: nesting past ``MAX_BODY_DEPTH``,
    or bytes that are not the UTF-8 they claim (FastAPI's answer was a 400 'There was an error
    parsing the body', naming nothing)."""
    if exceeds_depth(body, MAX_BODY_DEPTH):
        return (f"body: JSON nested more than {MAX_BODY_DEPTH} levels deep; no request of this API "
                "nests that far, send the object its schema describes")
    if json.detect_encoding(body) == "utf-8":
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"body: not UTF-8 (byte {exc.start}); send JSON encoded as UTF-8"
    return None


def _refusal(path: str, message: str) -> JSONResponse:
    """A 4xx from the middleware, in the shape of the API that ``path`` belongs to."""
    if path.startswith(OPENAI_PATH):
        return openai_error(400, message, code="invalid_input")
    return JSONResponse(error_body("invalid_input", message), status_code=422)


def _replay(body: bytes, last: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body read already (then ``last``), then the client's own."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if last is not None:
        pending = [{"type": "http.request", "body": body, "more_body": True}, last]

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _is_json(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower().endswith("json")


def _bad_text(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, str]]:
    """(dotted path, ``control`` | ``surrogate``) of the strings and keys of ``value`` that hold one."""
    if depth > MAX_BODY_DEPTH:  # BoundedJsonBodies refused deeper bodies before they were parsed
        return
    if isinstance(value, str):
        if TEXT_CONTROL.search(value):
            yield path, "control"
        elif lone_surrogate_at(value) is not None:
            yield path, "surrogate"
    elif isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if CONTROL.search(key):
                yield child, "control"
            elif lone_surrogate_at(key) is not None:
                yield path or "body", "surrogate"
            yield from _bad_text(item, child, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _bad_text(item, f"{path}.{i}" if path else str(i), depth + 1)


def _text_error(name: str, kind: str, *, param: str | None) -> InvalidInput:
    text = shown(name)
    if kind == "surrogate":
        return InvalidInput(
            f"{text}: holds an unpaired surrogate (\\ud800-\\udfff without its partner), which is no "
            "character; remove it, or send the character itself",
            param=shown(param) if param is not None else None,
        )
    return InvalidInput(
        f"{text}: contains a control character (NUL \\u0000 or %00, or another of U+0000-U+001F, U+007F), "
        "which no id, name or field here can hold; remove it",
        param=shown(param) if param is not None else None,
    )


def shown(name: str) -> str:
    """``name`` with its control characters and surrogates escaped (``a\\u0000b``), so the
    answer can be encoded and read."""
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in name)
