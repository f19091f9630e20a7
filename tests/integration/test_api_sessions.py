"""Chat sessions at the door, both stores, no worker: ``/v1/sessions`` starts, lists and ends one (a
queued session ends at once), ``/v1/jobs`` does not list it; ``/openai/v1/chat/completions`` and
``/completions`` answer bad input in OpenAI's shape naming the param before any session starts, and a
request whose session cannot load in time (no worker here) waits the stated bound, then answers 503
``session_starting`` with ``Retry-After``; its retry finds the same session. Requests answered by a
real worker: tests/integration/e2e/test_openai_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.settings import Settings
from tests.integration.helpers import bearer

pytestmark = pytest.mark.integration
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def quick(settings: Settings, admin_key: str) -> Iterator[TestClient]:
    """The app with a short start wait (no worker will load anything here)."""
    fast = settings.model_copy(update={"session_start_wait_s": 0.3, "session_poll_interval_s": 0.02})
    with TestClient(create_app(fast), headers=bearer(admin_key)) as client:
        yield client


def test_a_session_starts_is_listed_and_ends_at_once_while_queued(client: TestClient) -> None:
    created = client.post("/v1/sessions", json={"models": ["tiny"], "name": "s1", "idle_timeout_s": 60})
    assert created.status_code == 201, created.text
    session = created.json()
    assert (session["status"], session["ready"], session["models"], session["idle_timeout_s"]) == (
        "queued", False, ["tiny"], 60)
    assert [s["id"] for s in client.get("/v1/sessions").json()["data"]] == [session["id"]]
    assert client.get(f"/v1/sessions/{session['id']}").json()["name"] == "s1"
    assert session["id"] not in {j["id"] for j in client.get("/v1/jobs").json()["data"]}, "sessions are not jobs' list"
    as_job = client.get(f"/v1/jobs/{session['id']}")  # was a 500: its adapters' names read as a preflight
    assert as_job.status_code == 200 and (as_job.json()["kind"], as_job.json()["preflight"]) == ("session", None)
    ended = client.delete(f"/v1/sessions/{session['id']}")
    assert ended.status_code == 200 and ended.json()["status"] == "cancelled"
    assert client.get("/v1/sessions").json()["data"] == []
    assert [s["id"] for s in client.get("/v1/sessions", params={"all": "true"}).json()["data"]] == [session["id"]]
    for body, param in (({"models": []}, "models"), ({"models": ["tiny"], "gpus": 2}, "gpus"),
                        ({"models": ["job:nope"]}, "models"), ({"models": ["no-such-base"]}, "model")):
        refused = client.post("/v1/sessions", json=body)
        assert refused.status_code in (404, 422) and refused.json()["error"]["param"] == param, refused.text


def test_bad_input_answers_openai_errors_before_a_session_starts(client: TestClient, oai: openai.OpenAI) -> None:
    cases = [(dict(model="no-such-model"), openai.NotFoundError, "model"),
             (dict(model="tiny", temperature=3), openai.BadRequestError, "temperature"),
             (dict(model="tiny", top_logprobs=2), openai.BadRequestError, "top_logprobs"),
             (dict(model="tiny", tools=[{"type": "function", "function": {"name": "f"}}]), openai.BadRequestError,
              "tools"),
             (dict(model="tiny", n=17), openai.BadRequestError, "n")]
    for kwargs, error, param in cases:
        with pytest.raises(error) as refused:
            oai.chat.completions.create(messages=CHAT, **kwargs)
        assert refused.value.response.json()["error"]["param"] == param, refused.value.response.json()
    assert refused.value.response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model="tiny", prompt="x", echo=True)
    assert refused.value.response.json()["error"]["param"] == "echo"
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.completions.create(model="no-such-model", prompt="x")
    assert unknown.value.code == "model_not_found"
    assert client.get("/v1/sessions").json()["data"] == [], "no session was started for a refused request"


def test_a_session_that_cannot_load_in_time_answers_503_with_retry_after(quick: TestClient) -> None:
    first = quick.post("/openai/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
    assert first.status_code == 503 and first.headers["retry-after"] == "5", first.text
    error = first.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("session_starting", "server_error", "model")
    [session] = quick.get("/v1/sessions").json()["data"]
    assert session["id"] in error["message"] and session["status"] == "queued"
    again = quick.post("/openai/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True})
    assert again.status_code == 503
    assert [s["id"] for s in quick.get("/v1/sessions").json()["data"]] == [session["id"]], "the retry finds it"
