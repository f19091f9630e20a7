"""Limits every request's input must respect before a route runs, because the store cannot hold
what lies beyond them and would answer a 500 instead of a 4xx naming the field.

* Text: PostgreSQL refuses the NUL character (``\\x00``) in ``text`` and ``jsonb`` values, so a
  NUL in a path parameter, a query parameter or any string (or key) of a JSON body is a 422 that
  names where it is (``name``, ``hyperparameters.suffix``, ``owner``, ``job_id``).
* Integers: ``INT32_MAX`` / ``INT64_MAX`` bound the query and path integers that meet an
  ``integer`` / ``bigint`` column (``after_step``, a checkpoint's ``step``, ``max_running_jobs``,
  an event ``seq``); routes and schemas declare them with ``le=``.

``check_request_text`` is an app-wide dependency (``create_app``). It reads a JSON body only
when the route already parsed it (FastAPI caches it on the request), never a streamed upload.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import Request

from core.errors import InvalidInput

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
NUL = "\x00"


async def check_request_text(request: Request) -> None:
    """Refuse a NUL character anywhere the store would meet it (see the module docstring)."""
    for where, params in (("path", request.path_params), ("query", request.query_params)):
        for name, value in params.items():
            if isinstance(value, str) and NUL in value:
                raise _nul_error(name, where)
    if _is_json(request) and getattr(request, "_body", None):
        body: bytes = request._body
        if b"\\u0000" in body.lower():
            try:
                document = json.loads(body)
            except (ValueError, RecursionError):
                return  # the route's own parsing refuses it
            for path in _nul_paths(document, ""):
                raise _nul_error(path or "body", "body")


def _is_json(request: Request) -> bool:
    content_type = request.headers.get("content-type", "")
    return content_type.split(";")[0].strip().lower().endswith("json")


def _nul_paths(value: Any, path: str, depth: int = 0) -> Iterator[str]:
    """Dotted paths (``messages.2.content``) of the strings and keys in ``value`` holding a NUL."""
    if depth > 64:
        return
    if isinstance(value, str):
        if NUL in value:
            yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if NUL in key:
                yield child
            yield from _nul_paths(item, child, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _nul_paths(item, f"{path}.{i}" if path else str(i), depth + 1)


def _nul_error(name: str, where: str) -> InvalidInput:
    shown = name.replace(NUL, "\\u0000")
    return InvalidInput(
        f"{shown}: contains a NUL character (\\u0000 or %00), which no text field can hold; remove it",
        param=shown if where != "body" or shown != "body" else None,
    )
