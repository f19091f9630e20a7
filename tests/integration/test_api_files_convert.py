"""Uploads of ShareGPT and Alpaca files (core.files.convert through POST /v1/files): a field of the
wrong type is a 422 naming the line and the field, a line over the cap is refused while it is
read, and nothing is stored either way."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.files import validate
from core.files.models import File
from core.settings import Settings

pytestmark = pytest.mark.integration

SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
ALPACA = {"instruction": "Add one to one.", "output": "2"}


def post(client: TestClient, body: bytes, **fields: str):
    return client.post("/v1/files", files={"file": ("d.jsonl", body)}, data={"purpose": "train", **fields})


def lines(*records: dict) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def assert_refused(response, line: int, message: str, store, settings: Settings) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["line"]) == ("invalid_dataset", "file", line)
    assert error["message"] == message
    with store.sessions() as session:
        assert session.scalar(select(func.count()).select_from(File)) == 0
    assert [p for p in settings.files_dir.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize(("records", "fields", "message"), [
    ((SHAREGPT, {**SHAREGPT, "system": 7}), {}, "line 2: 'system' must be a string (or absent), not a number (7)"),
    ((SHAREGPT, {**SHAREGPT, "system": {"text": "be brief"}}), {"format": "sharegpt"},
     "line 2: 'system' must be a string (or absent), not an object"),
    ((ALPACA, {**ALPACA, "system": ["be", "brief"]}), {}, "line 2: 'system' must be a string (or absent), not an array"),
    ((ALPACA, {**ALPACA, "input": 0}), {}, "line 2: 'input' must be a string (or absent), not a number (0)"),
    ((ALPACA, {**ALPACA, "input": False}), {"format": "alpaca"},
     "line 2: 'input' must be a string (or absent), not a boolean (false)"),
])
def test_a_field_of_the_wrong_type_is_422_naming_line_and_field(client: TestClient, store, settings: Settings,
                                                                  records, fields, message) -> None:
    assert_refused(post(client, lines(*records), **fields), 2, message, store, settings)


@pytest.mark.parametrize("fields", [{}, {"format": "sharegpt"}])
def test_a_first_line_over_the_cap_is_refused_while_read(client: TestClient, store, settings: Settings,
                                                          monkeypatch, fields) -> None:
    monkeypatch.setattr(validate, "MAX_LINE_BYTES", 4096)  # 64 MiB in service; the same cap as native files
    line = json.dumps({"conversations": [{"from": "human", "value": "x" * 20_000}, {"from": "gpt", "value": "y"}]})
    response = post(client, (line + "\n").encode(), **fields)
    assert_refused(response, 1, "line 1: longer than 4096 bytes; split the record", store, settings)


def test_a_conforming_file_still_converts(client: TestClient, store) -> None:
    response = post(client, lines({**SHAREGPT, "system": "Be brief."}, {**SHAREGPT, "system": None}))
    assert response.status_code == 201, response.text
    assert response.json()["stats"]["converted_from"] == "sharegpt"
