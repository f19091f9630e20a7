"""/healthz, /readyz (names what is down), /v1/hardware, OpenAPI."""

from __future__ import annotations

import datetime as dt

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.db import utcnow
from core.settings import Settings
from core.workers.models import Worker

pytestmark = pytest.mark.integration


def test_healthz_and_readyz_when_everything_is_up(client: TestClient, store) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"store": "ok", "broker": "ok"}}


def test_readyz_checks_redis_when_configured(store, settings: Settings, redis_url: str) -> None:
    with TestClient(create_app(settings.model_copy(update={"redis_url": redis_url, "broker_url": redis_url}))) as c:
        response = c.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json()["checks"] == {"store": "ok", "broker": "ok", "redis": "ok"}


@pytest.mark.parametrize("down", ["broker", "store"])
def test_readyz_is_503_naming_what_is_down(store, settings: Settings, down: str) -> None:
    dead = "127.0.0.1:1"  # nothing listens on port 1
    update = (
        {"broker_url": f"redis://{dead}/0"}
        if down == "broker"
        else {"database_url": f"postgresql+psycopg://postgres@{dead}/ftq"}
    )
    with TestClient(create_app(settings.model_copy(update=update))) as c:
        response = c.get("/readyz")
        assert c.get("/healthz").status_code == 200
    assert response.status_code == 503
    body = response.json()
    assert body["error"]["code"] == "unavailable"
    assert body["error"]["message"].startswith(f"not ready: {down} unreachable")
    up = "store" if down == "broker" else "broker"
    assert body["checks"][up] == "ok"
    assert body["checks"][down].startswith("unreachable")


def test_hardware_lists_workers_with_liveness(client: TestClient, store) -> None:
    now = utcnow()
    plan = {"device": "cuda", "dtype": "bfloat16", "model_attention": "sdpa",
            "decisions": [{"name": "packed_metadata_cache", "requested": "auto", "enabled": True,
                           "backend": "triton", "reason": "packed batches"}]}
    with store.sessions() as session:
        session.add_all(
            [
                Worker(worker_id="w-gpu0", hostname="box", device="cuda:0",
                       hardware={"hardware": {"device": "NVIDIA H200"}, "plan": plan},
                       current_job_id=None, started_at=now, heartbeat_at=now),
                Worker(worker_id="w-gpu1", hostname="box", device="cuda:1", hardware={"device": "NVIDIA H200"},
                       current_job_id="job-x", started_at=now, heartbeat_at=now - dt.timedelta(minutes=10)),
            ]
        )
        session.commit()
    workers = client.get("/v1/hardware").json()["data"]
    assert [(w["id"], w["device"], w["alive"], w["current_job"]) for w in workers] == [
        ("w-gpu0", "cuda:0", True, None),
        ("w-gpu1", "cuda:1", False, "job-x"),
    ]
    assert {key: workers[0]["plan"][key] for key in plan} == plan
    assert workers[0]["hardware"] == {"device": "NVIDIA H200"}
    assert workers[1]["plan"] is None
    assert workers[1]["heartbeat_age_s"] >= 599


def test_a_worker_plan_of_another_shape_is_answered_as_null(client: TestClient, store) -> None:
    now = utcnow()
    with store.sessions() as session:
        session.add(Worker(worker_id="w-old", hostname="box", device="cpu",
                           hardware={"hardware": {"device": "cpu"}, "plan": [{"name": "packed_metadata_cache"}]},
                           current_job_id=None, started_at=now, heartbeat_at=now))
        session.commit()
    response = client.get("/v1/hardware")
    assert response.status_code == 200
    assert [(w["id"], w["plan"]) for w in response.json()["data"]] == [("w-old", None)]


def test_openapi_and_docs_are_served(client: TestClient, store) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/v1/files", "/v1/jobs", "/v1/jobs/{job_id}/events", "/v1/hardware", "/readyz"} <= set(schema["paths"])
    assert "multipart/form-data" in schema["paths"]["/v1/files"]["post"]["requestBody"]["content"]
    assert client.get("/docs").status_code == 200


def test_unknown_route_uses_the_error_envelope(client: TestClient, store) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json() == {"error": {"code": "not_found", "message": "Not Found", "param": None}}


def test_startup_refuses_a_store_nobody_migrated(tmp_path, settings: Settings) -> None:
    blank = settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'blank.db'}"})
    with pytest.raises(RuntimeError, match=r"has no schema, this ftq expects revision .*run `ftq db upgrade`"):
        with TestClient(create_app(blank)):
            pass


def test_an_idle_connection_outlives_the_clients_own_idle_expiry(store, settings: Settings) -> None:
    """A client that pauses 6 s between two requests on one keep-alive connection (httpx keeps
    idle connections 5 s; uvicorn's default closed them at 5 s too, and a request sent at that
    instant got "Server disconnected without sending a response") is answered on the same
    connection: ``ftq api`` keeps idle connections ``KEEP_ALIVE_S``."""
    import socket
    import time

    from cli.serve import KEEP_ALIVE_S
    from tests.integration.helpers import LiveServer

    assert KEEP_ALIVE_S > 60
    request = b"GET /healthz HTTP/1.1\r\nHost: ftq\r\n\r\n"
    with LiveServer(settings) as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        answers = []
        for pause in (0, 6):
            time.sleep(pause)
            sock.sendall(request)
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):  # headers and body may come in two segments
                chunk = sock.recv(65536)
                if not chunk:  # closed: the connection did not outlive the pause
                    break
                answer += chunk
            answers.append(answer)
    assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b'{"status":"ok"}') for a in answers), answers


def test_the_api_stops_at_sigterm_while_an_event_stream_is_open(client: TestClient, store, settings: Settings) -> None:
    """A dashboard following a queued job (a stream that ends only with its job) does not keep a
    stopped API alive: uvicorn cancels open requests ``SHUTDOWN_GRACE_S`` after the signal."""
    import threading

    import httpx

    from tests.integration.helpers import LiveServer, spec, upload

    job_id = client.post("/v1/jobs", json=spec(upload(client))).json()["id"]
    server = LiveServer(settings)
    opened, cut = threading.Event(), threading.Event()

    def follow() -> None:
        with httpx.stream("GET", f"{server.url}/v1/jobs/{job_id}/events", headers=dict(client.headers),
                          timeout=120) as stream:
            opened.set()
            try:
                for _ in stream.iter_bytes():
                    pass
            except httpx.RemoteProtocolError:  # the stream is cut at the grace's end, as it should be
                cut.set()

    with server:
        viewer = threading.Thread(target=follow, daemon=True)
        viewer.start()
        assert opened.wait(30), "the event stream never opened"
        server.server.should_exit = True
        server.thread.join(timeout=60)
        assert not server.thread.is_alive(), "the API was still serving the open stream 60 s after SIGTERM"
        viewer.join(timeout=30)
    assert cut.is_set(), "the viewer's stream did not end with the API"
