"""Bad input the attack of issue 10 turned into 500s (or a dropped stream): each is now a 4xx
whose ``param`` names the field, on PostgreSQL (which refuses NUL and out-of-range integers)
and on SQLite alike. Also: another user's Idempotency-Key is a 409 that names none of her job."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.integration.helpers import bearer, make_user, spec, upload

pytestmark = pytest.mark.integration

HUGE = 2**64 + 1


def assert_422(response, param: str | None, fragment: str = "") -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert fragment in error["message"], error["message"]


class TestNulCharacters:
    def test_in_a_job_name_and_a_key_name(self, client: TestClient, store) -> None:
        file_id = upload(client)
        assert_422(client.post("/v1/jobs", json=spec(file_id, name="a\x00b")), "name", "NUL")
        assert_422(client.post("/v1/users/me/keys", json={"name": "lap\x00top"}), "name", "NUL")
        assert_422(client.post("/v1/users", json={"name": "\x00"}), "name", "NUL")
        assert client.get("/v1/jobs").json()["data"] == []

    def test_in_filters_and_path_ids(self, client: TestClient, store) -> None:
        assert_422(client.get("/v1/jobs", params={"owner": "a\x00"}), "owner", "NUL")
        assert_422(client.get("/v1/files", params={"owner": "\x00"}), "owner", "NUL")
        assert_422(client.get("/v1/jobs/job-%00"), "job_id", "NUL")
        assert_422(client.get("/v1/files/file-%00"), "file_id", "NUL")
        assert_422(client.get("/v1/users/%00/keys"), "name", "NUL")
        assert_422(client.delete("/v1/keys/%00"), "key_id", "NUL")


class TestIntegersBeyondTheColumns:
    def test_after_step_checkpoint_step_and_the_running_cap(self, client: TestClient, store) -> None:
        assert_422(client.get("/v1/jobs/job-x/metrics", params={"after_step": HUGE}), "after_step")
        assert_422(client.get(f"/v1/jobs/job-x/checkpoints/{HUGE}/download"), "step")
        make_user(store, "bob")
        assert_422(client.patch("/v1/users/bob", json={"max_running_jobs": HUGE}), "max_running_jobs")
        assert_422(client.patch("/v1/users/bob", json={"max_running_jobs": 2**31}), "max_running_jobs")
        assert_422(client.post("/v1/users", json={"name": "carol", "max_running_jobs": 2**40}), "max_running_jobs")

    def test_event_stream_start_beyond_any_seq_is_refused_not_dropped(self, client: TestClient, store) -> None:
        url = "/v1/jobs/job-x/events"  # refused before the job is looked up
        assert_422(client.get(url, params={"after": "99999999999999999999"}), "after")
        response = client.get(url, headers={"Last-Event-ID": "9" * 30})
        assert_422(response, "Last-Event-ID")


class TestDatasetLines:
    @pytest.mark.parametrize(
        ("line", "fragment"),
        [
            ('{"text": "a", "m": ' + "[" * 5_000 + "]" * 5_000 + "}", "nested too deeply"),
            ('{"text": "a", "n": ' + "9" * 5000 + "}", "4,300 digits"),
        ],
        ids=["deep-nesting", "huge-integer"],
    )
    def test_is_a_422_naming_the_line(self, client: TestClient, store, line: str, fragment: str) -> None:
        body = json.dumps({"text": "ok"}) + "\n" + line + "\n"
        response = client.post("/v1/files", files={"file": ("d.jsonl", body)}, data={"purpose": "train"})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["line"] == 2 and fragment in error["message"], error


class TestTokenStatistics:
    @pytest.mark.parametrize("model", ["no-such-model", "org/no-such-model", "\x00", "../etc"])
    def test_a_model_the_box_cannot_resolve_is_a_422_naming_model(
        self, client: TestClient, store, model: str
    ) -> None:
        file_id = upload(client)
        response = client.get(f"/v1/files/{file_id}/tokens", params={"model": model})
        assert_422(response, "model")


def upload_as(client: TestClient, key: str) -> str:
    response = client.post(
        "/v1/files", files={"file": ("d.jsonl", '{"text": "hi"}\n')}, data={"purpose": "train"}, headers=bearer(key)
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


class TestIdempotencyKeyOfAnotherUser:
    @pytest.mark.slow  # submissions run the preflight (a tokenizer process): seconds each
    @pytest.mark.parametrize("store", ["postgresql"], indirect=True)
    def test_is_a_409_that_names_none_of_her_job(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        a_file = upload_as(client, alice)
        b_file = upload_as(client, bob)
        headers = {"Idempotency-Key": "shared-key"} | bearer(alice)
        created = client.post("/v1/jobs", json=spec(a_file, name="alice's"), headers=headers)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        bob_headers = {"Idempotency-Key": "shared-key"} | bearer(bob)
        for body in (spec(a_file, name="alice's"), spec(b_file, name="other body")):
            response = client.post("/v1/jobs", json=body, headers=bob_headers)
            assert response.status_code in (403, 409), response.text
            assert job_id not in response.text
        same_body_other_file = client.post("/v1/jobs", json=spec(b_file, name="x"), headers=bob_headers)
        assert same_body_other_file.status_code == 409 and job_id not in same_body_other_file.text
