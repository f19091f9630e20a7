"""Every route of the app, every method, every kind of bad credential: 401 (or the CSRF 403),
never the route's answer. Enumerated from the app itself, so a route added later is checked
without anyone remembering to list it (issue 10: a nested router once served
``GET /v1/files/{id}/tokens`` to anyone, because the gate looked at the route's template).

Also the failed-key throttle: a stored key's failures lock that key's id, other failures the
address's unknown keys, each logged (key id, never the secret) and answered 429 with
``Retry-After``; a valid key is never refused for other keys' failures.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.convertors import IntegerConvertor
from starlette.routing import Mount

from api.auth import CSRF_HEADER, SESSION_COOKIE, is_open
from api.workers.auth import WORKER_ONLY, is_worker_path
from core.settings import Settings
from core.users import service as users
from tests.integration.helpers import bearer, make_user, make_worker_key, serve, upload

pytestmark = pytest.mark.integration


def concrete_routes(routes: list[Any]) -> Iterator[tuple[str, str, str]]:
    """``(method, template, concrete path)`` of every endpoint, mounts and nested routers included
    (FastAPI keeps an included router as one entry whose ``effective_candidates`` are its routes,
    with the prefixes applied)."""
    for route in routes:
        if hasattr(route, "effective_candidates"):
            yield from concrete_routes(route.effective_candidates())
            continue
        original = getattr(route, "original_route", route)
        if isinstance(original, Mount):
            yield "GET", original.path + "/{path}", original.path + "/app.js"
            continue
        template = getattr(route, "path", None)
        if not template:
            continue
        path = template
        for name, convertor in getattr(route, "param_convertors", {}).items():
            value = "1" if isinstance(convertor, IntegerConvertor) else "x-1"
            for form in ("{%s}", "{%s:int}", "{%s:path}"):
                path = path.replace(form % name, value)
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            yield method, template, path


def keyed_routes(app) -> list[tuple[str, str, str]]:
    return [r for r in concrete_routes(app.routes) if not is_open(r[2]) and r[0] != "HEAD"]


@pytest.fixture
def gate(settings: Settings, admin_key: str) -> Iterator[TestClient]:
    """A client with no key of its own, on an app whose failed-key limit is off."""
    from api.app import create_app

    app = create_app(settings.model_copy(update={"auth_failure_limit": 0}))
    with TestClient(app) as client:
        yield client


def bad_credentials(store, gate: TestClient, admin_key: str) -> dict[str, dict[str, str]]:
    revoked = make_user(store, "revoked")
    gate.delete(f"/v1/keys/{users.split_key(revoked)[0]}", headers=bearer(admin_key)).raise_for_status()
    disabled = make_user(store, "disabled")
    gate.patch("/v1/users/disabled", json={"disabled": True}, headers=bearer(admin_key)).raise_for_status()
    revoked_worker = make_worker_key(store, "revoked-box")
    gate.delete("/v1/workers/keys/revoked-box", headers=bearer(admin_key)).raise_for_status()
    return {
        "none": {},
        "malformed": bearer("not-a-key"),
        "wrong scheme": {"Authorization": f"Basic {admin_key}"},
        "unknown": bearer("ftq_0123abcd_" + "A" * 43),
        "revoked": bearer(revoked),
        "disabled user": bearer(disabled),
        "revoked cookie": {"Cookie": f"{SESSION_COOKIE}={revoked}"},
        "disabled cookie": {"Cookie": f"{SESSION_COOKIE}={disabled}"},
        "unknown worker key": bearer("ftqw_0123abcd_" + "A" * 43),
        "revoked worker key": bearer(revoked_worker),
        "malformed worker key": bearer("ftqw_nothex_x"),
    }


USER_KEY_KINDS = frozenset({"unknown", "revoked", "disabled user"})


def expected_refusal(path: str, kind: str) -> int:
    """Worker routes: 401 for a bad worker key or none, 403 for any user's key (worker keys only).
    Other routes: 401 for a bad user key or none, 403 for any worker key (users' keys only)."""
    if is_worker_path(path):
        return 403 if kind in USER_KEY_KINDS else 401
    return 403 if "worker key" in kind else 401


class TestEveryRouteNeedsAKey:
    def test_enumeration_reaches_nested_routers_and_mounts(self, gate: TestClient, store) -> None:
        templates = {(m, t) for m, t, _ in concrete_routes(gate.app.routes)}
        assert ("GET", "/v1/files/{file_id}/tokens") in templates
        assert ("GET", "/v1/jobs/{job_id}/events") in templates
        assert ("GET", "/static/{path}") in templates
        assert len(keyed_routes(gate.app)) >= 20

    def test_every_route_refuses_every_bad_credential(self, gate: TestClient, store, admin_key: str) -> None:
        kinds = bad_credentials(store, gate, admin_key)
        answered: list[str] = []
        for method, template, path in keyed_routes(gate.app):
            for kind, headers in kinds.items():
                response = gate.request(method, path, headers=headers)
                expected = expected_refusal(path, kind)
                if response.status_code != expected:
                    answered.append(f"{method} {template} with {kind}: {response.status_code}, not {expected}")
                    continue
                error = response.json()["error"]
                assert error["code"] == ("unauthenticated" if expected == 401 else "forbidden")
                assert error["param"] == "Authorization"
                if expected == 401:
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert not answered, "routes that did not refuse a bad key:\n" + "\n".join(answered)

    def test_worker_keys_open_only_the_worker_routes_and_user_keys_never_open_them(
        self, gate: TestClient, store, admin_key: str
    ) -> None:
        worker_key = make_worker_key(store, "box-2")
        routes = keyed_routes(gate.app)
        worker_routes = [r for r in routes if is_worker_path(r[2])]
        assert {t for _, t, _ in worker_routes} >= {
            "/v1/worker/files/{file_id}", "/v1/worker/jobs/{job_id}/artifacts/{path:path}"
        }
        wrong: list[str] = []
        for method, template, path in routes:
            if is_worker_path(path):
                user = gate.request(method, path, headers=bearer(admin_key))
                worker = gate.request(method, path, headers=bearer(worker_key))
                if user.status_code != 403 or "only worker keys" not in user.json()["error"]["message"]:
                    wrong.append(f"{method} {template} with an admin's key: {user.status_code}")
                if worker.status_code in (401, 403):  # past the gate: the route answers (404, 422, 400)
                    wrong.append(f"{method} {template} with a worker key: {worker.status_code} {worker.text}")
            else:
                worker = gate.request(method, path, headers=bearer(worker_key))
                if worker.status_code != 403 or worker.json()["error"]["message"] != WORKER_ONLY:
                    wrong.append(f"{method} {template} with a worker key: {worker.status_code}")
        assert not wrong, "\n".join(wrong)

    def test_a_good_cookie_still_needs_the_csrf_header_to_change_anything(
        self, gate: TestClient, store, admin_key: str
    ) -> None:
        cookie = {"Cookie": f"{SESSION_COOKIE}={admin_key}"}
        unsafe = [(m, t, p) for m, t, p in keyed_routes(gate.app) if m not in ("GET", "HEAD", "OPTIONS")]
        assert len(unsafe) >= 6
        for method, template, path in unsafe:
            response = gate.request(method, path, headers=cookie)
            if is_worker_path(path):  # worker routes read only the Authorization header, never the cookie
                assert response.status_code == 401, f"{method} {template}: {response.status_code}"
                continue
            assert response.status_code == 403, f"{method} {template}: {response.status_code}"
            assert response.json()["error"]["param"] == CSRF_HEADER

    def test_unknown_paths_are_refused_before_routing(self, gate: TestClient, store) -> None:
        for path in ["/v1/nope", "/anything", "/v1/files/x/tokens/extra", "/static", "/healthz/"]:
            assert gate.get(path).status_code == 401, path

    def test_token_statistics_need_a_key_and_work_with_one(
        self, gate: TestClient, store, admin_key: str
    ) -> None:
        gate.headers.update(bearer(admin_key))
        file_id = upload(gate)
        del gate.headers["Authorization"]
        url = f"/v1/files/{file_id}/tokens?model=tiny"
        assert gate.get(url).status_code == 401
        assert gate.get(url, headers=bearer("ftq_0123abcd_nope")).status_code == 401
        with_key = gate.get(f"/v1/files/{file_id}/tokens?model=nope", headers=bearer(admin_key))
        assert with_key.status_code == 422 and with_key.json()["error"]["param"] == "model"

    def test_open_paths_answer_without_a_key(self, gate: TestClient, store) -> None:
        for path in ["/healthz", "/readyz", "/docs", "/redoc", "/openapi.json", "/", "/static/app.js"]:
            assert gate.get(path).status_code == 200, path
        assert gate.delete("/v1/session").status_code == 204


class TestFailedKeyThrottle:
    """Issue 23: the throttle once counted per address, so one script with a revoked key locked a
    whole NAT, or the dashboard and CLI on the box itself, out for a minute. Now failures of a key
    the store has count against that key's id, the rest against the address, and a valid key is
    never refused for other keys' failures."""

    def test_600_bad_keys_from_127_0_0_1_then_a_valid_key_answers_at_once(
        self, settings: Settings, store, admin_key: str
    ) -> None:
        revoked = make_user(store, "script")
        with serve(settings) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            http.delete(f"/v1/keys/{users.split_key(revoked)[0]}", headers=bearer(admin_key)).raise_for_status()
            codes = [http.get("/v1/jobs", headers=bearer(revoked)).status_code for _ in range(600)]
            assert codes[:20] == [401] * 20 and set(codes[20:]) == {429}  # FTQ_AUTH_FAILURE_LIMIT 20
            assert http.get("/v1/jobs", headers=bearer(admin_key)).status_code == 200
            assert http.get("/openai/v1/files", headers=bearer(admin_key)).status_code == 200
            again = http.get("/v1/jobs", headers=bearer(revoked))
            assert again.status_code == 429 and int(again.headers["Retry-After"]) >= 1
            error = again.json()["error"]
            assert error["param"] == "Authorization" and f"ftq_{users.split_key(revoked)[0]}" in error["message"]
            # The dashboard's cookie and OpenAI's shape: the same key, the same lock.
            assert http.get("/v1/jobs", headers={"Cookie": f"{SESSION_COOKIE}={revoked}"}).status_code == 429
            assert http.get("/openai/v1/files", headers=bearer(revoked)).json()["error"]["type"] == "rate_limit_error"

    def test_a_locked_key_id_refuses_even_its_right_secret_and_only_that_key(
        self, settings: Settings, store, admin_key: str
    ) -> None:
        from api.app import create_app

        alice = make_user(store, "alice")
        prefix, _ = users.split_key(alice)
        guesses = [bearer(f"ftq_{prefix}_guess{i}") for i in range(4)]
        app = create_app(settings.model_copy(update={"auth_failure_limit": 3}))
        with TestClient(app, client=("127.0.0.1", 1)) as http:
            assert [http.get("/v1/jobs", headers=h).status_code for h in guesses] == [401, 401, 401, 429]
            assert http.get("/v1/jobs", headers=bearer(alice)).status_code == 429  # no oracle while locked
            assert http.get("/v1/jobs", headers=bearer(admin_key)).status_code == 200
            assert http.get("/v1/jobs", headers=bearer("ftq_0123abcd_" + "A" * 43)).status_code == 401

    def test_an_unknown_id_flood_locks_that_addresses_unknown_ids_not_its_valid_keys(
        self, settings: Settings, store, admin_key: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        from api.app import create_app

        revoked = make_user(store, "revoked")
        app = create_app(settings.model_copy(update={"auth_failure_limit": 3}))
        unknown = "ftq_0123abcd_" + "S" * 43
        with caplog.at_level(logging.WARNING, logger="api.auth"), TestClient(app, client=("10.0.0.9", 1)) as http:
            http.delete(f"/v1/keys/{users.split_key(revoked)[0]}", headers=bearer(admin_key)).raise_for_status()
            codes = [http.get("/v1/jobs", headers=bearer(unknown)).status_code for _ in range(5)]
            assert codes == [401, 401, 401, 429, 429]
            refused = http.get("/v1/jobs", headers=bearer("ftq_fedcba98_" + "S" * 43))  # another unknown id
            assert refused.status_code == 429 and "from this address" in refused.json()["error"]["message"]
            for headers in ({}, bearer("not-a-key"), {"Authorization": f"Basic {admin_key}"}):
                assert http.get("/v1/jobs", headers=headers).status_code == 429
            assert http.get("/v1/jobs", headers=bearer(admin_key)).status_code == 200
            assert http.get("/v1/jobs", headers=bearer(revoked)).status_code == 401  # its own bucket
        with TestClient(app, client=("10.0.0.10", 1)) as neighbour:
            assert neighbour.get("/v1/jobs", headers=bearer(unknown)).status_code == 401
        failures = [r.getMessage() for r in caplog.records if "failed API key" in r.getMessage()]
        assert len(failures) == 5 and all("10.0.0.9" in m or "10.0.0.10" in m for m in failures)
        assert sum("ftq_0123abcd" in m for m in failures) == 4
        assert not any("SSSS" in r.getMessage() for r in caplog.records)

    def test_worker_keys_count_per_key_id_too(self, settings: Settings, store, admin_key: str) -> None:
        from api.app import create_app

        revoked = make_worker_key(store, "old-box")
        good = make_worker_key(store, "box")
        app = create_app(settings.model_copy(update={"auth_failure_limit": 3}))
        path = "/v1/worker/files/file-000000000000000000000000"
        with TestClient(app, client=("127.0.0.1", 1)) as http:
            http.delete("/v1/workers/keys/old-box", headers=bearer(admin_key)).raise_for_status()
            codes = [http.get(path, headers=bearer(revoked)).status_code for _ in range(5)]
            assert codes == [401, 401, 401, 429, 429]
            assert http.get(path, headers=bearer(good)).status_code not in (401, 429)  # past the gate
            assert http.get("/v1/jobs", headers=bearer(admin_key)).status_code == 200
