"""Plain helpers the API tests share (functions, not fixtures; those are in conftest.py): users
and their keys, a dataset upload, a job body, a finished job, a live uvicorn server."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from fastapi.testclient import TestClient

from core.jobs import service
from core.jobs.states import JobStatus
from core.settings import Settings
from tests.helpers import CHAT_RECORD


def make_user(store, name: str, *, is_admin: bool = False, max_running_jobs: int | None = None) -> str:
    """Create a user in ``store`` and return its API key (through the service, as the CLI does)."""
    from core.users.service import create_user_with_key

    with store.sessions() as session:
        _user, issued = create_user_with_key(session, name, is_admin=is_admin, max_running_jobs=max_running_jobs)
        session.commit()
        return issued.secret


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def upload(client: TestClient, purpose: str = "train", record: dict = CHAT_RECORD) -> str:
    response = client.post(
        "/v1/files", files={"file": ("d.jsonl", json.dumps(record) + "\n")}, data={"purpose": purpose}
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def spec(training_file: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "training_file": training_file, "hyperparameters": {"max_steps": 3}}
    body.update(overrides)
    return body


def finish(store, job_id: str, status: JobStatus = JobStatus.succeeded) -> int:
    with store.sessions() as session:
        service.transition(session, job_id, JobStatus.running)
        assert service.transition(session, job_id, status)
        seq = service.append_events(session, job_id, [service.state_event(status)])[-1].seq
        session.commit()
        return seq


class LiveServer:
    """A real uvicorn serving the app in a thread (for streaming responses)."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from api.app import create_app
        from cli.serve import api_server_config

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        config = api_server_config(create_app(settings), "127.0.0.1", self.port, "warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(settings: Settings) -> LiveServer:
    return LiveServer(settings)


def make_worker_key(store, name: str) -> str:
    """Create a worker key in ``store`` and return it (``ftqw_...``, as `ftq workers key create` prints)."""
    from core.workers.keys import create_worker_key

    with store.sessions() as session:
        _row, raw = create_worker_key(session, name, created_by=None)
        session.commit()
        return raw
