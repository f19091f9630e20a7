"""No 5xx from input (issue 23 item 5): each request that answered a 500 in the attack of
2026-11-27 is now a 4xx in the API's error shape, on PostgreSQL (which refuses NUL in text):
control characters in path ids, queries, JSON bodies and multipart fields of both APIs; JSON
nested thousands deep in a dataset line or a request body; a lone surrogate; a 4,000-character
``model`` on the tokens route; malformed export ids; OpenAI's metadata limits.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings
from tests.integration.helpers import LiveServer, bearer, spec, upload

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("store", ["postgresql"], indirect=True)]

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
CONTROLS = ["%00", "%01", "%0A", "%1F", "%7F"]
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def assert_openai_400(response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == OPENAI_ERROR_KEYS and error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    return error


def assert_native_422(response, param: str | None) -> dict:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert {"code", "message", "param"} <= set(error) and error["code"] == "invalid_input", error
    assert error["param"] == param, error
    return error


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def multipart(filename: str, fields: dict[str, str]) -> dict:
    """``client.post`` arguments for a dataset upload sent byte for byte (httpx would write a NUL
    in a filename as ``%00``, which is no NUL)."""
    parts = [f'Content-Disposition: form-data; name="file"; filename="{filename}"\r\n\r\n{json.dumps(CHAT)}']
    parts += [f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}' for name, value in fields.items()]
    body = "".join(f"--B0undary\r\n{part}\r\n" for part in parts) + "--B0undary--\r\n"
    return {"content": body.encode(), "headers": {"Content-Type": "multipart/form-data; boundary=B0undary"}}


class TestControlCharactersOnOpenAIRoutes:
    @pytest.mark.parametrize("char", CONTROLS)
    @pytest.mark.parametrize(
        ("method", "url", "param"),
        [
            ("GET", "/openai/v1/files/{c}", "file_id"),
            ("GET", "/openai/v1/files/file-{c}/content", "file_id"),
            ("DELETE", "/openai/v1/files/file-{c}", "file_id"),
            ("GET", "/openai/v1/files/file-results-{c}", "file_id"),
            ("GET", "/openai/v1/files/file-results-{c}/content", "file_id"),
            ("GET", "/openai/v1/fine_tuning/jobs/{c}", "job_id"),
            ("POST", "/openai/v1/fine_tuning/jobs/job-{c}/cancel", "job_id"),
            ("GET", "/openai/v1/fine_tuning/jobs/job-{c}/events", "job_id"),
            ("GET", "/openai/v1/fine_tuning/jobs/job-{c}/checkpoints", "job_id"),
            ("GET", "/openai/v1/files?after=file-{c}", "after"),
            ("GET", "/openai/v1/fine_tuning/jobs?after=job-{c}", "after"),
            ("GET", "/openai/v1/fine_tuning/jobs/job-x/events?after=ev-{c}", "after"),
            ("GET", "/openai/v1/fine_tuning/jobs/job-x/checkpoints?after=ckpt-{c}", "after"),
        ],
    )
    def test_in_a_path_id_or_after_is_a_400_naming_it(
        self, client: TestClient, store, method: str, url: str, param: str, char: str
    ) -> None:
        error = assert_openai_400(client.request(method, url.format(c=char)), param)
        assert "control character" in error["message"], error

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({"metadata": {"team\x00": "a"}}, "metadata.team\\u0000"),
            ({"metadata": {"team": "a\x00b"}}, "metadata.team"),
            ({"metadata": {"team": "a\x1bb"}}, "metadata.team"),
            ({"training_file": "file-\x00"}, "training_file"),
            ({"validation_file": "\x00"}, "validation_file"),
        ],
        ids=["metadata-key", "metadata-value", "metadata-escape", "training_file", "validation_file"],
    )
    def test_in_a_job_body_is_a_400_naming_the_field(self, client: TestClient, store, body: dict,
                                                        param: str) -> None:
        training_file = upload(client)
        response = client.post("/openai/v1/fine_tuning/jobs",
                               json={"model": "tiny", "training_file": training_file} | body)
        assert_openai_400(response, param)
        assert client.get("/v1/jobs").json()["data"] == []

    @pytest.mark.parametrize(
        ("filename", "fields", "param"),
        [("d\x00.jsonl", {"purpose": "fine-tune"}, "file"), ("d.jsonl", {"purpose": "fine-tune\x00"}, "purpose"),
         ("d.jsonl", {"purpose": "fine-tune", "format": "auto\x07"}, "format")],
        ids=["filename", "purpose", "format"],
    )
    def test_in_a_multipart_field_is_a_400_and_nothing_is_stored(self, client: TestClient, store, filename: str,
                                                                  fields: dict, param: str) -> None:
        assert_openai_400(client.post("/openai/v1/files", **multipart(filename, fields)), param)
        assert client.get("/openai/v1/files").json()["data"] == []


class TestControlCharactersOnNativeRoutes:
    @pytest.mark.parametrize("char", CONTROLS)
    @pytest.mark.parametrize(
        ("method", "url", "param"),
        [
            ("GET", "/v1/files/file-{c}", "file_id"),
            ("DELETE", "/v1/files/file-{c}", "file_id"),
            ("GET", "/v1/files/file-{c}/tokens?model=tiny", "file_id"),
            ("GET", "/v1/jobs/job-{c}", "job_id"),
            ("POST", "/v1/jobs/job-{c}/cancel", "job_id"),
            ("GET", "/v1/jobs/job-{c}/metrics", "job_id"),
            ("GET", "/v1/jobs/job-{c}/checkpoints", "job_id"),
            ("GET", "/v1/jobs/job-{c}/exports", "job_id"),
            ("GET", "/v1/files?after=file-{c}", "after"),
            ("GET", "/v1/jobs?after=job-{c}", "after"),
            ("GET", "/v1/jobs?status={c}", "status"),
        ],
    )
    def test_in_a_path_id_or_query_is_a_422_naming_it(
        self, client: TestClient, store, method: str, url: str, param: str, char: str
    ) -> None:
        error = assert_native_422(client.request(method, url.format(c=char)), param)
        assert "control character" in error["message"], error

    def test_in_a_job_body_is_a_422_naming_the_field_but_newlines_stay_legal(self, client: TestClient, store) -> None:
        file_id = upload(client)
        assert_native_422(client.post("/v1/jobs", json=spec(file_id, name="a\x07b")), "name")
        assert_native_422(client.post("/v1/jobs", json=spec(file_id, **{"a\x01": 1})), "a\\u0001")
        assert_native_422(client.post("/v1/jobs", json=spec(file_id) | {"training_file": file_id + "\x00"}),
                          "training_file")
        assert client.get("/v1/jobs").json()["data"] == []
        preview = client.post("/v1/jobs/preview", json=spec(file_id, sample_prompts=["line one\n\tline two"]))
        assert preview.status_code == 200, preview.text

    @pytest.mark.parametrize(
        ("filename", "data", "param"),
        [("d\x00.jsonl", {"purpose": "train"}, "file"), ("d.jsonl", {"purpose": "train\x00"}, "purpose"),
         ("d.jsonl", {"purpose": "train", "format": "\x1fauto"}, "format")],
        ids=["filename", "purpose", "format"],
    )
    def test_in_a_multipart_field_is_a_422_and_nothing_is_stored(self, client: TestClient, store, filename: str,
                                                                  data: dict, param: str) -> None:
        assert_native_422(client.post("/v1/files", **multipart(filename, data)), param)
        assert client.get("/v1/files").json()["data"] == []


class TestLoneSurrogates:
    def test_in_a_sharegpt_value_is_a_422_naming_line_and_field(self, client: TestClient, store) -> None:
        good = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
        bad = good.replace('"yo"', '"y\\ud800o"')
        response = client.post("/v1/files", files={"file": ("d.jsonl", f"{good}\n{bad}\n")},
                               data={"purpose": "train"})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["line"] == 2 and "conversations[1].value" in error["message"], error
        assert client.get("/v1/files").json()["data"] == []

    def test_a_surrogate_pair_is_the_character_it_escapes(self, client: TestClient, store) -> None:
        line = json.dumps({"conversations": [{"from": "human", "value": "hi \U0001f600"},
                                             {"from": "gpt", "value": "yo"}]})  # ensure_ascii: \ud83d\ude00
        response = client.post("/v1/files", files={"file": ("d.jsonl", line + "\n")}, data={"purpose": "train"})
        assert response.status_code == 201, response.text

    def test_in_a_json_body_is_a_4xx_naming_the_field(self, client: TestClient, store) -> None:
        file_id = upload(client)
        body = json.dumps(spec(file_id, name="x")).replace('"name": "x"', '"name": "x\\udc00"')
        response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
        assert "surrogate" in assert_native_422(response, "name")["message"]
        body = json.dumps({"model": "tiny", "training_file": file_id, "metadata": {"k": "v"}})
        response = client.post("/openai/v1/fine_tuning/jobs", content=body.replace('"v"', '"\\ud800"'),
                               headers={"Content-Type": "application/json"})
        assert_openai_400(response, "metadata.k")


@pytest.fixture
def roomy_client(settings: Settings, admin_key: str) -> Iterator[TestClient]:
    """``client`` with a 1 MiB upload limit: a line nested 100,000 deep is 200 kB."""
    from api.app import create_app

    with TestClient(create_app(settings.model_copy(update={"max_upload_bytes": 1 << 20})),
                    headers=bearer(admin_key)) as test_client:
        yield test_client


class TestDeeplyNestedJson:
    LAYOUTS = {
        "chat": '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "x": %s}',
        "text": '{"text": "a", "x": %s}',
        "sharegpt": '{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}], "x": %s}',
        "alpaca": '{"instruction": "a", "output": "b", "x": %s}',
    }

    @pytest.mark.parametrize("depth", [2_000, 50_000, 100_000])
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    @pytest.mark.parametrize("line", [1, 2])
    def test_a_dataset_line_is_a_422_naming_the_line(self, roomy_client: TestClient, store, layout: str,
                                                     depth: int, line: int) -> None:
        template = self.LAYOUTS[layout]
        lines = [template % "1"] * (line - 1) + [template % nested(depth)]
        response = roomy_client.post("/v1/files", files={"file": ("d.jsonl", "\n".join(lines) + "\n")},
                                     data={"purpose": "train"})
        assert response.status_code == 422, response.text[:500]
        error = response.json()["error"]
        assert error["line"] == line and "nested too deeply" in error["message"], error

    @pytest.mark.parametrize("depth", [5_000, 100_000])
    def test_a_request_body_is_a_4xx_in_the_apis_shape(self, client: TestClient, store, depth: int) -> None:
        body = '{"format": "merged", "x": %s}' % nested(depth)
        response = client.post("/v1/jobs/job-x/exports", content=body, headers={"Content-Type": "application/json"})
        error = assert_native_422(response, None)
        assert "nested more than 32 levels" in error["message"], error
        body = '{"model": "tiny", "training_file": "file-x", "metadata": %s}' % nested(depth)
        response = client.post("/openai/v1/fine_tuning/jobs", content=body,
                               headers={"Content-Type": "application/json"})
        assert "nested more than 32 levels" in assert_openai_400(response, None)["message"]

    def test_a_body_not_utf8_is_a_4xx_in_the_apis_shape_not_a_parser_message(self, client: TestClient,
                                                                               store) -> None:
        body = b'{"name": "ng\xd8\xbf\xad\xc4-B"}'  # what schemathesis sent POST /v1/projects
        response = client.post("/v1/users", content=body, headers={"Content-Type": "application/json"})
        assert "not UTF-8 (byte 14)" in assert_native_422(response, None)["message"]
        response = client.post("/openai/v1/fine_tuning/jobs", content=body, headers={"Content-Type": "application/json"})
        assert "not UTF-8" in assert_openai_400(response, None)["message"]

    def test_a_body_within_the_bound_still_reaches_its_route(self, client: TestClient, store) -> None:
        response = client.post("/v1/jobs/job-x/exports", json={"format": "merged", "x": [[[[]]]]})
        assert_native_422(response, "x")  # the route's own schema answers, not the depth bound


class TestTokensModel:
    @pytest.mark.parametrize("model", ["m" * 4_000, "m" * 300, " tiny"], ids=["4000-chars", "300-chars", "space"])
    def test_is_checked_as_the_job_route_checks_it(self, client: TestClient, store, model: str) -> None:
        file_id = upload(client)
        tokens = client.get(f"/v1/files/{file_id}/tokens", params={"model": model})
        job = client.post("/v1/jobs", json=spec(file_id, model=model))
        assert_native_422(tokens, "model")
        assert_native_422(job, "model")
        if len(model) > 512:
            assert tokens.json()["error"]["message"] == job.json()["error"]["message"]


class TestExportIds:
    MALFORMED = ["exp-000000000000000000000000", "exp-%00", "%2e%2e", "..%2f..%2fetc", "exp-..%5c..", "x" * 300,
                 "a/b"]
    AS_IS = ["..", "../download", "%2e%2e/download", "..%2f..%2fetc/download", "..%252f..%252fetc", "%2e%2e%2f"]

    def test_unknown_or_malformed_is_one_404_on_every_export_route(self, client: TestClient, store) -> None:
        job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
        for export_id in self.MALFORMED:
            for suffix in ("", "/download"):
                response = client.get(f"/v1/jobs/{job_id}/exports/{export_id}{suffix}")
                assert response.status_code == 404, (export_id, suffix, response.text)
                error = response.json()["error"]
                assert error["code"] == "not_found" and error["param"] == "export_id", (export_id, suffix, error)
                assert error["message"].startswith("export "), error
                assert error["message"].endswith(f" of job {job_id} does not exist"), error

    def test_dot_dot_sent_as_is_is_the_same_404_not_the_job(self, client: TestClient, settings: Settings,
                                                            admin_key: str, store) -> None:
        """httpx and curl resolve ``..`` before they send (``/v1/jobs/<id>``, the job itself, is then
        what was asked for); sent as is, ``..`` is an export id like any malformed one."""
        job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
        with LiveServer(settings) as server:
            host = urlsplit(server.url)
            conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
            for path in (f"/v1/jobs/{job_id}/exports/{rest}" for rest in self.AS_IS):
                conn.request("GET", path, headers=bearer(admin_key))
                response = conn.getresponse()
                body = json.loads(response.read())
                assert response.status == 404 and body["error"]["param"] == "export_id", (path, body)
                assert job_id not in json.dumps(body).replace(f"of job {job_id}", ""), body
            conn.close()


class TestOpenAIMetadataLimits:
    @pytest.mark.parametrize(
        ("metadata", "fragment"),
        [
            ({f"k{i}": "v" for i in range(17)}, "17 keys; at most 16"),
            ({"k" * 65: "v"}, "65 characters; at most 64"),
            ({"k": "v" * 513}, "513 characters; at most 512"),
            ({"k": 1}, "values must be strings"),
            ({"k": {"nested": "v"}}, "values must be strings"),
            (["k", "v"], "must be an object"),
        ],
        ids=["17-keys", "65-char-key", "513-char-value", "number", "object", "list"],
    )
    def test_beyond_openais_limits_is_a_400_naming_metadata(self, client: TestClient, store, metadata,
                                                           fragment: str) -> None:
        body = {"model": "tiny", "training_file": upload(client), "metadata": metadata}
        error = assert_openai_400(client.post("/openai/v1/fine_tuning/jobs", json=body), "metadata")
        assert fragment in error["message"], error

    @pytest.mark.slow  # a submission runs the preflight (a tokenizer process)
    def test_at_openais_limits_is_accepted(self, client: TestClient, store) -> None:
        metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
        body = {"model": "tiny", "training_file": upload(client), "metadata": metadata}
        response = client.post("/openai/v1/fine_tuning/jobs", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["metadata"] == metadata
