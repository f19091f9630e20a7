"""Uploads: the same dataset again is the same file (per owner and purpose); ShareGPT and Alpaca
files are stored converted to chat messages, and the upload says so. Both stores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.files.models import File
from tests.helpers import CHAT_RECORD
from tests.integration.helpers import bearer, make_user

pytestmark = pytest.mark.integration


def post(client, records: list[dict], purpose: str = "train", name: str = "d.jsonl", headers=None, **fields):
    body = "".join(json.dumps(r) + "\n" for r in records)
    return client.post("/v1/files", files={"file": (name, body)}, data={"purpose": purpose, **fields},
                       headers=headers or {})


class TestSameBytesAgain:
    def test_a_second_upload_of_the_same_bytes_is_the_first_file(self, client, store) -> None:
        first = post(client, [CHAT_RECORD], name="a.jsonl").json()
        again = post(client, [CHAT_RECORD], name="renamed.jsonl")
        assert again.status_code in (200, 201) and again.json()["id"] == first["id"]
        assert len(client.get("/v1/files").json()["data"]) == 1
        with store.sessions() as session:
            assert len(session.query(File).all()) == 1

    def test_another_purpose_owner_or_content_is_another_file(self, client, store) -> None:
        first = post(client, [CHAT_RECORD]).json()["id"]
        assert post(client, [CHAT_RECORD], purpose="validation").json()["id"] != first
        assert post(client, [CHAT_RECORD, CHAT_RECORD]).json()["id"] != first
        alice = make_user(store, "alice")
        assert post(client, [CHAT_RECORD], headers=bearer(alice)).json()["id"] != first

    def test_a_deleted_file_is_uploaded_anew(self, client) -> None:
        first = post(client, [CHAT_RECORD]).json()["id"]
        assert client.delete(f"/v1/files/{first}").status_code == 200
        assert post(client, [CHAT_RECORD]).json()["id"] != first


class TestConversion:
    def test_sharegpt_is_stored_as_chat_and_says_so(self, client, store) -> None:
        record = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
        response = post(client, [record, record])
        assert response.status_code == 201, response.text
        out = response.json()
        assert out["format"] == "chat" and out["num_records"] == 2
        assert out["stats"]["converted_from"] == "sharegpt"
        with store.sessions() as session:
            stored = Path(session.get(File, out["id"]).path).read_text().splitlines()
        assert json.loads(stored[0]) == {"messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello"}]}

    def test_alpaca_with_and_without_input(self, client, store) -> None:
        records = [{"instruction": "Translate", "input": "chat", "output": "cat"},
                   {"instruction": "Say hi", "input": "", "output": "hi"}]
        out = post(client, records).json()
        assert out["stats"]["converted_from"] == "alpaca" and out["num_records"] == 2
        with store.sessions() as session:
            lines = [json.loads(x)["messages"] for x in Path(session.get(File, out["id"]).path).read_text().splitlines()]
        assert lines[0] == [{"role": "user", "content": "Translate\n\nchat"}, {"role": "assistant", "content": "cat"}]
        assert lines[1][0] == {"role": "user", "content": "Say hi"}

    def test_a_record_that_does_not_convert_names_its_line(self, client) -> None:
        good = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
        bad = {"conversations": [{"from": "narrator", "value": "Once"}]}
        response = post(client, [good, bad])
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["line"] == 2 and "'narrator'" in error["message"] and "conversations[0]" in error["message"]
        only_human = {"conversations": [{"from": "human", "value": "Hi"}]}
        refused = post(client, [only_human])
        assert refused.status_code == 422 and "no assistant message" in refused.json()["error"]["message"]

    def test_an_explicit_format_converts_or_refuses_naming_the_line(self, client) -> None:
        alpaca = {"instruction": "Say hi", "output": "hi"}
        assert post(client, [alpaca], format="alpaca").json()["stats"]["converted_from"] == "alpaca"
        refused = post(client, [CHAT_RECORD], format="sharegpt")
        assert refused.status_code == 422 and refused.json()["error"]["line"] == 1
        assert "not a sharegpt record" in refused.json()["error"]["message"]
        unknown = post(client, [CHAT_RECORD], format="csv")
        assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "format"


class TestDeclaredFormatOfReusedBytes:
    """Issue 22 item 9: Alpaca bytes uploaded again with ``format=sharegpt`` answered 201 with the
    stored file, while new bytes with the same mismatch were a 422."""

    ALPACA = {"instruction": "Say hi", "output": "hi"}

    def test_bytes_stored_before_are_refused_as_new_bytes_are(self, client) -> None:
        stored = post(client, [self.ALPACA])
        assert stored.status_code == 201, stored.text
        again = post(client, [self.ALPACA], format="sharegpt")
        fresh = post(client, [self.ALPACA, self.ALPACA], format="sharegpt")
        for refused in (again, fresh):
            assert refused.status_code == 422, refused.text
            error = refused.json()["error"]
            assert (error["line"], error["param"]) == (1, "file") and "not a sharegpt record" in error["message"]
        assert again.json()["error"]["message"] == fresh.json()["error"]["message"]
        assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [stored.json()["id"]]

    def test_the_declared_format_that_matches_or_auto_is_the_stored_file(self, client) -> None:
        first = post(client, [self.ALPACA]).json()["id"]
        assert post(client, [self.ALPACA], format="alpaca").json()["id"] == first
        assert post(client, [self.ALPACA], format="auto").json()["id"] == first

    def test_chat_bytes_stored_before_are_not_alpaca(self, client) -> None:
        assert post(client, [CHAT_RECORD]).status_code == 201
        refused = post(client, [CHAT_RECORD], format="alpaca")
        assert refused.status_code == 422 and "not an alpaca record" in refused.json()["error"]["message"]

    def test_the_openai_route_checks_the_declared_format_the_same_way(self, client) -> None:
        def openai_post(fmt: str | None):
            body = json.dumps(self.ALPACA) + "\n"
            return client.post("/openai/v1/files", files={"file": ("d.jsonl", body)},
                               data={"purpose": "fine-tune", **({"format": fmt} if fmt else {})})

        stored = openai_post(None)
        assert stored.status_code == 200, stored.text
        assert openai_post("alpaca").json()["id"] == stored.json()["id"]
        refused = openai_post("sharegpt")
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "file" and error["message"].startswith("line 1: not a sharegpt record")
