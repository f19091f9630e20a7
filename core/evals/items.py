"""A run's items: read from a JSONL file or inline ``file_content``, checked against the eval's
``item_schema``, and rendered through the run's ``input_messages`` template into the prompts
the sampler completes. Every refusal names the line (1-based, of the file or of
``file_content``) and the field, before anything is stored.

The schema check is the subset of JSON Schema that item schemas use: ``type`` (one or a list
of ``object``, ``array``, ``string``, ``number``, ``integer``, ``boolean``, ``null``),
``properties``, ``required``, ``additionalProperties: false``, ``items`` and ``enum``; other
keywords are not checked (docs/evals.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from core.errors import InvalidDataset, InvalidInput
from trainer.graders import GraderError
from trainer.graders.template import render

MAX_ITEMS = 100_000
ROLES = ("system", "developer", "user", "assistant")
_SAMPLE_TAG = re.compile(r"\{\{\s*sample\b")
_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,), "number": (int, float),
                                       "integer": (int,), "boolean": (bool,), "null": (type(None),)}


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """An item schema as ``data_source_config.item_schema`` must be: an object whose ``type``s are known."""
    if not isinstance(schema, dict):
        raise InvalidInput(f"{param}: must be a JSON schema object, e.g. "
                           '{"type": "object", "properties": {"question": {"type": "string"}}}', param=param)
    _check_types(schema, param)
    return schema


def _check_types(schema: dict[str, Any], param: str) -> None:
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [] if kinds is None else [kinds]:
        if kind not in _TYPES:
            raise InvalidInput(f"{param}.type: {kind!r} is not one of {', '.join(_TYPES)}", param=f"{param}.type")
    for name, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict):
            _check_types(sub, f"{param}.properties.{name}")
    if isinstance(schema.get("items"), dict):
        _check_types(schema["items"], f"{param}.items")


def schema_errors(value: Any, schema: dict[str, Any], where: str = "item") -> str | None:
    """The first way ``value`` breaks ``schema`` (``item.answer: expected string, got integer``), or None."""
    kinds = schema.get("type")
    if kinds is not None:
        allowed = kinds if isinstance(kinds, list) else [kinds]
        if not any(_is(value, kind) for kind in allowed):
            return f"{where}: expected {' or '.join(allowed)}, got {_name(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: {json.dumps(value)} is not one of {json.dumps(schema['enum'])}"
    if isinstance(value, dict):
        return _object_errors(value, schema, where)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, element in enumerate(value):
            if (error := schema_errors(element, schema["items"], f"{where}[{i}]")) is not None:
                return error
    return None


def _object_errors(value: dict[str, Any], schema: dict[str, Any], where: str) -> str | None:
    properties = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in value:
            return f"{where}.{name}: missing (the eval's item_schema requires it)"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(value) - set(properties))
        if extra:
            return f"{where}.{extra[0]}: not in the item_schema's properties (additionalProperties is false)"
    for name, sub in properties.items():
        if name in value and isinstance(sub, dict) and (error := schema_errors(value[name], sub, f"{where}.{name}")):
            return error
    return None


def _is(value: Any, kind: str) -> bool:
    if kind in ("number", "integer") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[kind])


def _name(value: Any) -> str:
    for kind in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is(value, kind):
            return kind
    return type(value).__name__


def item_of(record: Any, line: int, param: str) -> dict[str, Any]:
    """The item of one record: ``{"item": {...}}`` (OpenAI's shape; ``sample`` is ignored) or a bare object."""
    if not isinstance(record, dict):
        raise InvalidDataset(f"{param}: line {line}: a JSON object is expected, got {_name(record)}", line=line,
                             param=param)
    item = record.get("item", record) if set(record) <= {"item", "sample"} else record
    if not isinstance(item, dict):
        raise InvalidDataset(f"{param}: line {line}: item must be an object, got {_name(item)}", line=line,
                             param=param)
    return item


def read_items(path: Path, param: str) -> list[dict[str, Any]]:
    """The items of a JSONL file (blank lines skipped); ``InvalidDataset`` names the first bad line."""
    items = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                raw = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidDataset(f"{param}: line {number}: not UTF-8 (byte {exc.start}); save the file as UTF-8",
                                     line=number, param=param) from None
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise InvalidDataset(f"{param}: line {number}: not JSON ({exc.msg} at column {exc.colno})",
                                     line=number, param=param) from None
            items.append(item_of(record, number, param))
            if len(items) > MAX_ITEMS:
                raise InvalidDataset(f"{param}: more than {MAX_ITEMS:,} items; split the file", line=number,
                                     param=param)
    if not items:
        raise InvalidDataset(f"{param}: the file holds no item: one JSON object per line, "
                             '{"item": {...}}', param=param)
    return items


def check_items(items: list[dict[str, Any]], schema: dict[str, Any], param: str) -> None:
    """Every item matches ``schema``; ``InvalidDataset`` names the first line that does not."""
    for number, item in enumerate(items, start=1):
        if (error := schema_errors(item, schema)) is not None:
            raise InvalidDataset(f"{param}: line {number}: {error}", line=number, param=param)


def check_template(template: Any, param: str) -> list[dict[str, str]]:
    """``input_messages.template``: a non-empty list of ``{"role", "content"}`` (content a string,
    or OpenAI's ``{"type": "input_text", "text"}``), roles known."""
    if not isinstance(template, list) or not template:
        raise InvalidInput(f"{param}: a non-empty list of messages is expected, e.g. "
                           '[{"role": "user", "content": "{{item.question}}"}]', param=param)
    messages = []
    for i, message in enumerate(template):
        where = f"{param}[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidInput(f"{where}.role: must be one of {', '.join(ROLES)}", param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, dict) and content.get("type") in ("input_text", "output_text"):
            content = content.get("text")
        if not isinstance(content, str):
            raise InvalidInput(f"{where}.content: must be a string (a text template: images and audio are not "
                               "served by ftq's sampler)", param=f"{where}.content")
        messages.append({"role": message["role"], "content": content})
    return messages


def render_prompts(template: list[dict[str, str]], items: list[dict[str, Any]], *, template_param: str,
                   items_param: str) -> list[dict[str, Any]]:
    """One prompts-file record per item: the messages rendered with ``{{item.x}}`` and the item.

    Raises:
        InvalidInput: a template names a field an item lacks, or the ``sample`` namespace (there is
            no sample before the model answers); the message names the line and the template.
    """
    records = []
    for number, item in enumerate(items, start=1):
        messages = []
        for i, message in enumerate(template):
            where = f"{template_param}[{i}].content"
            if _SAMPLE_TAG.search(message["content"]):
                raise InvalidInput(f"{where}: an input template may name item.* only; the sample is the model's "
                                   "answer to it", param=where)
            try:
                messages.append({"role": message["role"], "content": render(message["content"], {"item": item}, where)})
            except GraderError as exc:
                raise InvalidInput(f"{items_param}: line {number}: {exc.message}", param=where) from None
        records.append({"messages": messages, "item": item})
    return records


def summarize_file(path: Path) -> tuple[str, int, dict[str, Any]]:
    """``(format, items, stats)`` of an uploaded items file (purpose ``evals``); ``InvalidDataset``
    names its first bad line. The schema is the eval's: it is checked when a run names the file."""
    items = read_items(path, "file")
    keys = sorted({key for item in items for key in item})[:50]
    return "eval_items", len(items), {"item_keys": keys}
