"""Team sharing over the API: keys (401), ownership (403), admin override, session cookie."""

from __future__ import annotations

import datetime as dt
import io
import zipfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, select, update

from core.jobs.models import Checkpoint, Job
from core.users import service as users
from core.users.models import ApiKey, User
from tests.integration.helpers import bearer, finish, make_user, spec

pytestmark = pytest.mark.integration


def as_user(key: str) -> dict[str, str]:
    return bearer(key)


def submit(client: TestClient, key: str) -> str:
    """A job owned by the user of ``key`` (on that user's own file)."""
    file_id = upload_as(client, key)
    response = client.post("/v1/jobs", json=spec(file_id), headers=as_user(key))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def upload_as(client: TestClient, key: str) -> str:
    response = client.post(
        "/v1/files",
        files={"file": ("d.jsonl", '{"text": "hello"}\n')},
        data={"purpose": "train"},
        headers=as_user(key),
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def assert_401(response, fragment: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    error = response.json()["error"]
    assert error["code"] == "unauthenticated" and error["param"] == "Authorization"
    assert fragment in error["message"], error["message"]


class TestUnauthenticated:
    def test_no_header_is_401_saying_how_to_get_a_key(self, client: TestClient, store) -> None:
        del client.headers["Authorization"]
        for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/files"),
                             ("GET", "/v1/models"), ("GET", "/v1/hardware"), ("GET", "/v1/users/me"),
                             ("GET", "/v1/jobs/job-x/events"), ("DELETE", "/v1/files/file-x")]:
            assert_401(client.request(method, path), "needs an API key")

    def test_bad_malformed_and_wrong_scheme_keys_are_401(self, client: TestClient, store) -> None:
        key = make_user(store, "bob")
        forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        assert_401(client.get("/v1/jobs", headers=bearer(forged)), "not valid")
        assert_401(client.get("/v1/jobs", headers=bearer("ftq_00000000_nope")), "not valid")
        assert_401(client.get("/v1/jobs", headers=bearer("hunter2")), "malformed")
        assert_401(client.get("/v1/jobs", headers={"Authorization": f"Basic {key}"}), "Bearer <api key>")
        assert client.get("/v1/jobs", headers=bearer(key)).status_code == 200

    def test_revoked_key_is_401_and_other_keys_keep_working(self, client: TestClient, store) -> None:
        first = make_user(store, "bob")
        second = client.post("/v1/users/bob/keys", json={"name": "laptop"}).json()["api_key"]
        prefix = users.split_key(first)[0]
        revoked = client.delete(f"/v1/keys/{prefix}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        assert_401(client.get("/v1/jobs", headers=bearer(first)), "revoked")
        assert client.get("/v1/jobs", headers=bearer(second)).status_code == 200

    def test_disabled_user_is_401_until_enabled(self, client: TestClient, store) -> None:
        key = make_user(store, "bob")
        assert client.patch("/v1/users/bob", json={"disabled": True}).json()["disabled"] is True
        assert_401(client.get("/v1/jobs", headers=bearer(key)), "disabled")
        client.patch("/v1/users/bob", json={"disabled": False})
        assert client.get("/v1/jobs", headers=bearer(key)).status_code == 200

    def test_behind_a_proxy_root_path_every_route_still_needs_a_key(self, settings, store) -> None:
        """``uvicorn --root-path /ftq`` puts the prefix in front of the URL path the app sees."""
        from api.app import create_app

        with TestClient(create_app(settings), root_path="/ftq") as proxied:
            for path in ["/ftq/v1/jobs", "/ftq/v1/jobs/job-x/adapter", "/ftq/v1/hardware", "/ftq/v1/queue"]:
                assert_401(proxied.get(path), "needs an API key")
            assert proxied.get("/ftq/healthz").status_code == 200

    def test_probes_docs_and_dashboard_shell_stay_open(self, client: TestClient, store) -> None:
        del client.headers["Authorization"]
        for path in ["/healthz", "/readyz", "/docs", "/openapi.json", "/", "/static/app.js"]:
            assert client.get(path).status_code == 200, path
        schemes = client.get("/openapi.json").json()["components"]["securitySchemes"]
        assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}


class TestOwnership:
    def test_everyone_sees_all_jobs_with_their_owner(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        a_job, b_job = submit(client, alice), submit(client, bob)
        seen = {j["id"]: j["owner"] for j in client.get("/v1/jobs", headers=bearer(bob)).json()["data"]}
        assert seen == {a_job: "alice", b_job: "bob"}
        assert client.get(f"/v1/jobs/{a_job}", headers=bearer(bob)).json()["owner"] == "alice"
        assert client.get(f"/v1/jobs/{a_job}/metrics", headers=bearer(bob)).status_code == 200
        files = client.get("/v1/files", headers=bearer(alice)).json()["data"]
        assert sorted(f["owner"] for f in files) == ["alice", "bob"]
        with store.sessions() as session:
            owners = dict(session.execute(select(Job.job_id, Job.owner_id)).all())
            ids = dict(session.execute(select(User.name, User.user_id)).all())
        assert owners == {a_job: ids["alice"], b_job: ids["bob"]}

    def test_owner_filter_by_name_and_me(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        a_job, b_job = submit(client, alice), submit(client, bob)
        mine = client.get("/v1/jobs", params={"owner": "me"}, headers=bearer(alice)).json()["data"]
        assert [j["id"] for j in mine] == [a_job]
        bobs = client.get("/v1/jobs", params={"owner": "bob"}, headers=bearer(alice)).json()["data"]
        assert [j["id"] for j in bobs] == [b_job]
        unknown = client.get("/v1/jobs", params={"owner": "carol"})
        assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "owner"
        my_files = client.get("/v1/files", params={"owner": "me"}, headers=bearer(bob)).json()["data"]
        assert [f["owner"] for f in my_files] == ["bob"]

    def test_cancelling_someone_elses_job_is_403_naming_the_owner(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        job_id = submit(client, alice)
        response = client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(bob))
        assert response.status_code == 403
        error = response.json()["error"]
        assert error["code"] == "forbidden" and "'alice'" in error["message"] and "'bob'" in error["message"]
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(alice)).json()["status"] == "cancelled"

    def test_deleting_someone_elses_file_is_403(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        file_id = upload_as(client, alice)
        response = client.delete(f"/v1/files/{file_id}", headers=bearer(bob))
        assert response.status_code == 403 and "'alice'" in response.json()["error"]["message"]
        assert client.delete(f"/v1/files/{file_id}", headers=bearer(alice)).json()["deleted"] is True

    def test_admin_cancels_and_deletes_anyones(self, client: TestClient, store) -> None:
        alice = make_user(store, "alice")
        job_id = submit(client, alice)
        other_file = upload_as(client, alice)
        assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"  # client = admin
        assert client.delete(f"/v1/files/{other_file}").status_code == 200

    def test_a_job_may_use_only_its_submitters_files_unless_admin(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        alices_file = upload_as(client, alice)
        refused = client.post("/v1/jobs", json=spec(alices_file), headers=bearer(bob))
        assert refused.status_code == 403
        assert refused.json()["error"]["param"] == "training_file" and "'alice'" in refused.json()["error"]["message"]
        as_admin = client.post("/v1/jobs", json=spec(alices_file))
        assert as_admin.status_code == 201 and as_admin.json()["owner"] == "admin"

    def test_idempotency_key_of_another_user_is_409(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        body = spec(upload_as(client, alice))
        first = client.post("/v1/jobs", json=body, headers={**bearer(alice), "Idempotency-Key": "k1"})
        assert first.status_code == 201
        again = client.post("/v1/jobs", json=body, headers={**bearer(alice), "Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        body_b = spec(upload_as(client, bob))
        other = client.post("/v1/jobs", json=body_b, headers={**bearer(bob), "Idempotency-Key": "k1"})
        assert other.status_code == 409


class TestUsersApi:
    def test_me_and_admin_only_user_management(self, client: TestClient, store) -> None:
        bob = make_user(store, "bob")
        me = client.get("/v1/users/me", headers=bearer(bob)).json()
        assert (me["name"], me["is_admin"]) == ("bob", False)
        for method, path, body in [("GET", "/v1/users", None), ("POST", "/v1/users", {"name": "eve"}),
                                   ("PATCH", "/v1/users/bob", {"max_running_jobs": 9}),
                                   ("POST", "/v1/users/admin/keys", None)]:
            response = client.request(method, path, json=body, headers=bearer(bob))
            assert response.status_code == 403, (path, response.text)
            assert response.json()["error"]["code"] == "forbidden"

    def test_admin_creates_a_user_whose_key_works_once_shown(self, client: TestClient, store) -> None:
        created = client.post("/v1/users", json={"name": "carol", "max_running_jobs": 2})
        assert created.status_code == 201
        key = created.json()["api_key"]
        assert created.json()["user"]["max_running_jobs"] == 2
        assert client.get("/v1/users/me", headers=bearer(key)).json()["name"] == "carol"
        listed = client.get("/v1/users/carol/keys").json()["data"]
        assert [k["prefix"] for k in listed] == [users.split_key(key)[0]] and "api_key" not in listed[0]
        assert client.post("/v1/users", json={"name": "carol"}).status_code == 409
        bad = client.post("/v1/users", json={"name": "Bad Name"})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "name"

    def test_cap_is_set_and_cleared_by_admin(self, client: TestClient, store) -> None:
        make_user(store, "bob")
        assert client.patch("/v1/users/bob", json={"max_running_jobs": 1}).json()["max_running_jobs"] == 1
        assert client.patch("/v1/users/bob", json={"is_admin": False}).json()["max_running_jobs"] == 1
        assert client.patch("/v1/users/bob", json={"max_running_jobs": None}).json()["max_running_jobs"] is None
        assert client.patch("/v1/users/me", json={"disabled": True}).status_code == 403

    def test_users_revoke_their_own_keys_but_not_others(self, client: TestClient, store) -> None:
        alice, bob = make_user(store, "alice"), make_user(store, "bob")
        spare = client.post("/v1/users/me/keys", headers=bearer(bob)).json()
        assert spare["key"]["user"] == "bob"
        alices = client.get("/v1/users/me/keys", headers=bearer(alice)).json()["data"][0]["id"]
        refused = client.delete(f"/v1/keys/{alices}", headers=bearer(bob))
        assert refused.status_code == 403 and "'alice'" in refused.json()["error"]["message"]
        assert client.delete(f"/v1/keys/{spare['key']['id']}", headers=bearer(bob)).status_code == 200
        assert client.get("/v1/users/me", headers=bearer(spare["api_key"])).status_code == 401
        assert client.get("/v1/users/alice/keys", headers=bearer(bob)).status_code == 403


def test_keys_are_stored_hashed_only(client: TestClient, store) -> None:
    key = make_user(store, "bob")
    issued = client.post("/v1/users", json={"name": "carol"}).json()["api_key"]
    secrets = [key, issued, users.split_key(key)[1], users.split_key(issued)[1]]
    metadata = MetaData()
    metadata.reflect(store.engine)
    with store.engine.connect() as conn:
        dump = "\n".join(
            repr(row) for table in metadata.sorted_tables for row in conn.execute(table.select()).all()
        )
    assert "ftq_" not in dump.replace("ftq_test", "")
    for secret in secrets:
        assert secret not in dump
    with store.sessions() as session:
        stored = session.scalars(select(ApiKey.key_hash)).all()
    assert users.hash_key(key) in stored


def test_last_used_at_moves_at_most_once_a_minute(client: TestClient, store) -> None:
    key = make_user(store, "bob")
    prefix = users.split_key(key)[0]

    def last_used() -> dt.datetime | None:
        with store.sessions() as session:
            return session.scalar(select(ApiKey.last_used_at).where(ApiKey.prefix == prefix))

    assert last_used() is None
    client.get("/v1/users/me", headers=bearer(key))
    first = last_used()
    assert first is not None
    client.get("/v1/users/me", headers=bearer(key))
    assert last_used() == first
    old = first - dt.timedelta(minutes=2)
    with store.sessions() as session:
        session.execute(update(ApiKey).where(ApiKey.prefix == prefix).values(last_used_at=old))
        session.commit()
    client.get("/v1/users/me", headers=bearer(key))
    assert last_used() > first


class TestSessionCookie:
    def test_login_sets_an_httponly_strict_cookie_that_works_for_sse_and_downloads(
        self, client: TestClient, store, settings
    ) -> None:
        bob = make_user(store, "bob")
        job_id = submit(client, bob)
        finish(store, job_id)
        ckpt = settings.jobs_dir / job_id / "checkpoints" / "step-000001"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text("{}")
        with store.sessions() as session:
            session.add(Checkpoint(job_id=job_id, step=1, path=str(ckpt), bytes=2, final=False))
            session.commit()
        del client.headers["Authorization"]
        assert client.get(f"/v1/jobs/{job_id}/events").status_code == 401

        login = client.post("/v1/session", json={"api_key": bob})
        assert login.status_code == 200 and login.json()["user"]["name"] == "bob"
        cookie = login.headers["set-cookie"]
        assert "ftq_session=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        events = client.get(f"/v1/jobs/{job_id}/events")
        assert events.status_code == 200 and "event: state" in events.text
        download = client.get(f"/v1/jobs/{job_id}/checkpoints/1/download")
        with zipfile.ZipFile(io.BytesIO(download.content)) as zf:
            assert zf.read("state.json") == b"{}"

        logout = client.delete("/v1/session")
        assert logout.status_code == 204
        assert client.get("/v1/jobs").status_code == 401

    def test_cookie_mutations_need_the_csrf_header(self, client: TestClient, store) -> None:
        bob = make_user(store, "bob")
        job_id = submit(client, bob)
        del client.headers["Authorization"]
        client.post("/v1/session", json={"api_key": bob})
        refused = client.post(f"/v1/jobs/{job_id}/cancel")
        assert refused.status_code == 403 and refused.json()["error"]["param"] == "X-Requested-With"
        done = client.post(f"/v1/jobs/{job_id}/cancel", headers={"X-Requested-With": "ftq"})
        assert done.status_code == 200 and done.json()["status"] == "cancelled"

    def test_login_with_a_bad_or_revoked_key_is_401_and_sets_nothing(self, client: TestClient, store) -> None:
        bob = make_user(store, "bob")
        del client.headers["Authorization"]
        bad = client.post("/v1/session", json={"api_key": bob + "x"})
        assert bad.status_code == 401 and "set-cookie" not in bad.headers
        client.post("/v1/session", json={"api_key": bob})
        with store.sessions() as session:
            key = users.find_key(session, users.split_key(bob)[0])
            users.revoke_key(session, key)
            session.commit()
        assert_401(client.get("/v1/jobs"), "revoked")
