"""POST/GET/DELETE /v1/files against both stores: good uploads are kept, bad ones leave nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.files.models import File
from core.settings import Settings
from tests.helpers import CHAT_RECORD

pytestmark = pytest.mark.integration


def upload(client: TestClient, content: bytes, *, purpose: str = "train", filename: str = "data.jsonl"):
    return client.post("/v1/files", files={"file": (filename, content, "application/jsonl")}, data={"purpose": purpose})


def lines(*records: object) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def assert_nothing_kept(store, settings: Settings) -> None:
    with store.sessions() as session:
        assert session.scalar(select(func.count()).select_from(File)) == 0
    leftovers = [p for p in settings.files_dir.rglob("*") if p.is_file()]
    assert leftovers == []


class TestUpload:
    def test_chat_file_is_stored_with_hash_and_stats(self, client: TestClient, store, settings: Settings) -> None:
        content = lines(CHAT_RECORD, {"messages": [{"role": "system", "content": "s"}, *CHAT_RECORD["messages"]]})
        response = upload(client, content)
        assert response.status_code == 201, response.text
        body = response.json()
        assert body["id"].startswith("file-")
        assert body["format"] == "chat"
        assert body["num_records"] == 2
        assert body["bytes"] == len(content)
        assert body["sha256"] == hashlib.sha256(content).hexdigest()
        assert body["filename"] == "data.jsonl"
        assert body["stats"]["chars_per_record"] == {"min": 7, "mean": 7.5, "max": 8}
        with store.sessions() as session:
            row = session.get(File, body["id"])
            assert Path(row.path).read_bytes() == content
        assert client.get(f"/v1/files/{body['id']}").json() == body

    @pytest.mark.parametrize(
        ("content", "line", "fragment"),
        [
            (b"", 1, "no records"),
            (b"\n  \n\n", 1, "no records"),
            (b"not json\n", 1, "not valid JSON"),
            (lines({"text": "a"}) + b"[1, 2]\n", 2, "not an object"),
            (lines({"text": "a"}, {"prompt": "p", "completion": "c"}), 2, "line 1 is text"),
            (
                lines(CHAT_RECORD, {"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}),
                2,
                "no 'role'",
            ),
            (lines({"messages": [{"role": "user", "content": "only a question"}]}), 1, "no assistant message"),
            (lines({"prompt": "p"}), 1, "'completion' is missing"),
            (b'{"text": "ok"}\n\xff\xfe\n', 2, "not UTF-8"),
            (lines({"foo": 1}), 1, "no known format"),
        ],
        ids=["empty", "blank", "not-json", "not-object", "mixed", "missing-role", "no-assistant",
             "no-completion", "not-utf8", "unknown-format"],
    )
    def test_bad_file_names_first_bad_line_and_keeps_nothing(
        self, client: TestClient, store, settings: Settings, content: bytes, line: int, fragment: str
    ) -> None:
        response = upload(client, content)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_dataset"
        assert error["param"] == "file"
        assert error["line"] == line
        assert fragment in error["message"]
        assert_nothing_kept(store, settings)

    def test_over_size_limit_is_413_and_keeps_nothing(self, client: TestClient, store, settings: Settings) -> None:
        record = json.dumps({"text": "x" * 1000}).encode() + b"\n"
        content = record * (settings.max_upload_bytes // len(record) + 5)
        response = upload(client, content)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "too_large"
        assert "FTQ_MAX_UPLOAD_BYTES" in response.json()["error"]["message"]
        assert_nothing_kept(store, settings)

    def test_over_size_limit_without_content_length_is_caught_while_streaming(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        boundary = "ftqboundary"
        record = json.dumps({"text": "y" * 1000}).encode() + b"\n"
        payload = record * (settings.max_upload_bytes // len(record) + 5)
        head = (
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\ntrain\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\r\n"
        ).encode()

        def body():
            yield head
            for i in range(0, len(payload), 4096):
                yield payload[i : i + 4096]
            yield f"\r\n--{boundary}--\r\n".encode()

        response = client.post(
            "/v1/files", content=body(), headers={"content-type": f"multipart/form-data; boundary={boundary}"}
        )
        assert response.status_code == 413, response.text
        assert_nothing_kept(store, settings)

    def test_bad_purpose_and_missing_parts_are_refused(self, client: TestClient, store, settings: Settings) -> None:
        response = upload(client, lines({"text": "a"}), purpose="finetune")
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "purpose"
        response = client.post("/v1/files", data={"purpose": "train"})
        assert response.status_code == 422
        assert "'file'" in response.json()["error"]["message"]
        response = client.post("/v1/files", files={"file": ("a.jsonl", lines({"text": "a"}))})
        assert response.status_code == 422
        assert response.json()["error"]["param"] == "purpose"
        assert_nothing_kept(store, settings)


    def test_odd_multipart_bodies_are_refused_with_what_to_send(
        self, client: TestClient, store, settings: Settings
    ) -> None:
        good = lines({"text": "a"})
        two = client.post("/v1/files", files=[("file", ("a.jsonl", good)), ("file", ("b.jsonl", good))],
                          data={"purpose": "train"})
        assert two.status_code == 422 and "one file per upload" in two.json()["error"]["message"]
        named = client.post("/v1/files", files={"dataset": ("a.jsonl", good)}, data={"purpose": "train"})
        assert named.status_code == 422 and "'file' field" in named.json()["error"]["message"]
        raw = client.post("/v1/files", content=good, headers={"content-type": "application/jsonl"})
        assert raw.status_code == 422 and "multipart/form-data" in raw.json()["error"]["message"]
        assert_nothing_kept(store, settings)

    def test_file_sent_as_a_plain_field_is_still_the_dataset(self, client: TestClient, store) -> None:
        response = client.post("/v1/files", files={"file": (None, '{"text": "a"}\n')}, data={"purpose": "train"})
        assert response.status_code == 201, response.text
        assert (response.json()["filename"], response.json()["num_records"]) == ("upload.jsonl", 1)


class TestListAndDelete:
    def test_list_newest_first_with_cursor_and_purpose_filter(self, client: TestClient, store) -> None:
        ids = [upload(client, lines({"text": f"r{i}"}), purpose="train" if i % 2 else "validation").json()["id"]
               for i in range(5)]
        page = client.get("/v1/files", params={"limit": 2}).json()
        assert [f["id"] for f in page["data"]] == ids[::-1][:2]
        rest = client.get("/v1/files", params={"limit": 10, "after": page["next_cursor"]}).json()
        assert [f["id"] for f in rest["data"]] == ids[::-1][2:]
        assert rest["next_cursor"] is None
        train = client.get("/v1/files", params={"purpose": "train"}).json()["data"]
        assert {f["id"] for f in train} == {ids[1], ids[3]}

    def test_delete_removes_bytes_and_hides_the_file(self, client: TestClient, store) -> None:
        file_id = upload(client, lines({"text": "a"})).json()["id"]
        with store.sessions() as session:
            path = Path(session.get(File, file_id).path)
        response = client.delete(f"/v1/files/{file_id}")
        assert response.status_code == 200
        assert response.json() == {"id": file_id, "object": "file", "deleted": True}
        assert not path.exists()
        assert client.get(f"/v1/files/{file_id}").status_code == 404
        assert client.delete(f"/v1/files/{file_id}").status_code == 404
        assert client.get("/v1/files").json()["data"] == []

    def test_unknown_file_is_404_with_envelope(self, client: TestClient, store) -> None:
        response = client.get("/v1/files/file-000000000000000000000000")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
