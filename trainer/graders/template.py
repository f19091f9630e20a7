"""``{{ namespace.path }}`` templates, as OpenAI's graders render them.

Two namespaces: ``item`` (the dataset item) and ``sample`` (``output_text``, ``output_json``: the
output parsed as JSON when it is JSON, ``output_tools``, ``choices``). A path goes down objects by
``.key`` and lists by ``[index]``: ``{{ item.answers[0].text }}``, ``{{ sample.output_json.score }}``.
A string value is inserted as is, anything else as compact JSON. A template whose path is not in
the data is an error naming the template and the missing part, never an empty string.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trainer.graders.errors import GraderError

NAMESPACES = ("item", "sample")
_TAG = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_\-]*)|\[(\d+)\]|\[\"([^\"]*)\"\]|\['([^']*)'\]")


def parse_path(expression: str, param: str) -> tuple[str, list[str | int]]:
    """``item.a[0].b`` -> (``item``, [``a``, 0, ``b``]); an unknown namespace or bad syntax raises."""
    head = re.match(r"[A-Za-z_][A-Za-z0-9_]*", expression)
    if head is None or head.group(0) not in NAMESPACES:
        raise GraderError(f"{param}: template {{{{{expression}}}}} must start with item. or sample.", param)
    steps: list[str | int] = []
    at = head.end()
    while at < len(expression):
        step = _STEP.match(expression, at)
        if step is None:
            raise GraderError(f"{param}: template {{{{{expression}}}}} is not a path (item.key, item.list[0])", param)
        key, index, quoted, single = step.groups()
        steps.append(int(index) if index is not None else (key or quoted or single or ""))
        at = step.end()
    return head.group(0), steps


def check_template(text: str, param: str) -> None:
    """Every ``{{ }}`` in ``text`` names item.* or sample.*; raises ``GraderError`` otherwise."""
    for tag in _TAG.finditer(text):
        parse_path(tag.group(1), param)


def lookup(expression: str, namespaces: dict[str, Any], param: str) -> Any:
    name, steps = parse_path(expression, param)
    value = namespaces[name]
    walked = name
    for step in steps:
        if isinstance(step, int) and isinstance(value, list) and step < len(value):
            value = value[step]
        elif isinstance(step, str) and isinstance(value, dict) and step in value:
            value = value[step]
        else:
            shown = f"[{step}]" if isinstance(step, int) else f".{step}"
            raise GraderError(f"{param}: template {{{{{expression}}}}}: {walked} has no {shown.lstrip('.')!s}"
                              f"{' (output_text is not JSON)' if walked == 'sample.output_json' and value is None else ''}",
                              param)
        walked += f"[{step}]" if isinstance(step, int) else f".{step}"
    return value


def render(text: str, namespaces: dict[str, Any], param: str) -> str:
    """``text`` with each ``{{ path }}`` replaced by its value; a missing path raises ``GraderError``."""
    def one(tag: re.Match[str]) -> str:
        value = lookup(tag.group(1), namespaces, param)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    return _TAG.sub(one, text)


def sample_namespace(output_text: str) -> dict[str, Any]:
    """The ``sample`` namespace of one model output: ``output_json`` is its JSON, else None."""
    try:
        output_json = json.loads(output_text)
    except ValueError:
        output_json = None
    return {"output_text": output_text, "output_json": output_json, "output_tools": [],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": output_text}}]}
