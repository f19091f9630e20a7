"""Checks on JSON text that keep a parser or a store from failing on what a user sent.

* Depth, before parsing: Python's ``json`` recurses once per ``[`` or ``{``, so a line nested
  a few thousand levels deep raises ``RecursionError`` (or, in a thread with a small stack,
  worse), and whatever walks the parsed value afterwards (``json.dumps``, a validator, the
  store's JSON encoder) recurses as deeply. ``exceeds_depth`` measures the nesting on the bytes
  themselves: strings are cut out first (a ``[`` inside a string nests nothing), then the
  brackets are counted run by run, stopping as soon as the limit is passed.
* Lone surrogates, after parsing: ``"\\ud800"`` is valid JSON but no UTF-8 text, so writing
  it to a file or the store raises ``UnicodeEncodeError``. ``lone_surrogate_at`` names the
  first string (or key) holding one; ``may_hold_surrogate`` is the cheap test of the bytes that
  spares the walk to every line without a ``\\uD8xx``-``\\uDFxx`` escape.
"""

from __future__ import annotations

import re
from typing import Any

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_RUN = re.compile(rb"[\[{]+|[\]}]+")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def exceeds_depth(text: bytes, limit: int) -> bool:
    """Whether the JSON ``text`` nests arrays and objects more than ``limit`` levels deep.

    Linear in ``len(text)``; a text with at most ``limit`` opening brackets is answered by two
    counts. An unterminated string counts the brackets after its quote (the text is not valid
    JSON either way).
    """
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    skeleton = _STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    depth = 0
    for run in _RUN.finditer(skeleton):
        width = run.end() - run.start()
        if skeleton[run.start()] in b"[{":
            depth += width
            if depth > limit:
                return True
        else:
            depth -= width
    return False


def may_hold_surrogate(text: bytes) -> bool:
    """Whether ``text`` has a ``\\uD800``-``\\uDFFF`` escape (a pair, as in an escaped emoji, too)."""
    return _SURROGATE_ESCAPE.search(text) is not None


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (``conversations[2].value``, ``metadata.note``) of the first string or key in
    ``value`` holding a surrogate code point (what ``json`` makes of an unpaired ``\\ud800``),
    ``""`` for ``value`` itself, None when there is none. Recursive: bound the depth first."""
    if isinstance(value, str):
        return None if _is_utf8(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if not _is_utf8(key):  # the key itself is never shown: it cannot be encoded either
                return f"{path} (a key)" if path else "a key"
            found = lone_surrogate_at(item, child)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
