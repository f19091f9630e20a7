"""Every route of the app, every method, every kind of bad credential: 401 (or the CSRF 403),
never the route's answer. Enumerated from the app itself, so a route added later is checked
without anyone remembering to list it (issue 10: a nested router once served
``GET /v1/files/{id}/tokens`` to anyone, because the gate looked at the route's template).

Also: repeated failed keys from one address are logged (prefix, never the secret) and answered
429 with ``Retry-After``, while other addresses are unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.convertors import IntegerConvertor
from starlette.routing import Mount

from api.auth import CSRF_HEADER, SESSION_COOKIE, is_open
from api.workers.auth import WORKER_ONLY, is_worker_path
from core.settings import Settings
from core.users import service as users
from tests.integration.helpers import bearer, make_user, make_worker_key, upload

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
    def test_repeated_failures_from_one_address_are_logged_then_slowed(
        self, settings: Settings, store, admin_key: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        from api.app import create_app

        app = create_app(settings.model_copy(update={"auth_failure_limit": 3}))
        secret = "ftq_0123abcd_" + "S" * 43
        with caplog.at_level(logging.WARNING, logger="api.auth"), TestClient(app, client=("10.0.0.9", 1)) as attacker:
            codes = [attacker.get("/v1/jobs", headers=bearer(secret)).status_code for _ in range(4)]
            assert codes == [401, 401, 401, 429]
            refused = attacker.get("/v1/jobs", headers=bearer(admin_key))
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["param"] == "Authorization"
        with TestClient(app, client=("10.0.0.10", 1)) as neighbour:
            assert neighbour.get("/v1/jobs", headers=bearer(admin_key)).status_code == 200
        failures = [r.getMessage() for r in caplog.records if "failed API key" in r.getMessage()]
        assert len(failures) == 3 and all("10.0.0.9" in m and "0123abcd" in m for m in failures)
        assert not any("SSSS" in r.getMessage() for r in caplog.records)
