"""Another project's ids are unknown ids, on every route of both APIs (issue 23 items 1 and 2).

The routes come from the two OpenAPI schemas (``/openapi.json`` and the OpenAI app's): every
operation whose path takes an id is called by bob (a member of project ``team-q``) with alice's
ids (project ``team-p``), and must answer 404 exactly as it answers for ids that name nothing
(the same body once the ids it was asked about are masked), with no byte of alice's work in it:
no other id of hers, no file name, no job name, no dataset text, not her name nor her project's.
A route added later is probed without anyone listing it; a path parameter this test has no value
for, or a required body or query it cannot fill, fails the test until someone says what to send.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.openai.app import PREFIX as OPENAI_PREFIX
from api.openai.app import create_openai_app
from core.db import new_id
from core.exports import service as exports
from core.jobs.models import Checkpoint, StepMetric
from core.projects import service as projects
from core.users.service import create_user_with_key
from tests.integration.helpers import bearer, finish

pytestmark = pytest.mark.integration

SECRET_TEXT = "alice-p-secret-question"
RECORD = {"messages": [{"role": "user", "content": SECRET_TEXT}, {"role": "assistant", "content": "the answer"}]}

EXCLUDED = {
    # Users and keys belong to the box, not to a project: a non-admin reaches only their own
    # (``{name}`` below is a project's, on /v1/projects/...)
    # (403 otherwise; tests/integration/test_api_auth_routes.py), and no file, job or export is in them.
    "/v1/users/{name}", "/v1/users/{name}/keys", "/v1/keys/{key_id}",
    # Worker keys: admin only; no project's work in them.
    "/v1/workers/keys/{name}",
    # The workers' own routes take only worker keys (a user's key is 403 on any of them:
    # api/workers/auth.py), and a worker key reaches only the job it runs (tests/integration/test_api_worker_routes.py).
    "/v1/worker/files/{file_id}", "/v1/worker/jobs/{job_id}/artifacts/{path}",
    # Global admins only: 403 for anyone else before the name is looked up, the same for every name.
    "PATCH /v1/projects/{name}",
}
EVAL_RUN = {"data_source": {"type": "completions", "model": "tiny", "source": {
    "type": "file_content", "content": [{"item": {"question": SECRET_TEXT}}]}, "input_messages": {
    "type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}}}
BODIES = {("POST", "/v1/jobs/{job_id}/exports"): {"format": "merged"},
          **{("POST", f"{prefix}/evals/{{eval_id}}"): {"name": "renamed"} for prefix in ("/v1", "")},
          **{("POST", f"{prefix}/evals/{{eval_id}}/runs"): EVAL_RUN for prefix in ("/v1", "")}}
"""A body each route that requires one is sent (a valid one, so the 404 cannot be a 422 for the body)."""
QUERIES = {"model": "tiny"}
"""Values for required query parameters, by name."""


@dataclass(frozen=True)
class Work:
    """Alice's work in project team-p, and the strings none of bob's answers may hold."""

    ids: dict[str, list[str]]
    secrets: list[str]


@pytest.fixture
def keys(store) -> dict[str, str]:
    with store.sessions() as session:
        projects.create_project(session, "team-p")
        projects.create_project(session, "team-q")
        _, alice = create_user_with_key(session, "alice", project_names=["team-p"])
        _, bob = create_user_with_key(session, "bob", project_names=["team-q"])
        session.commit()
    return {"alice": alice.secret, "bob": bob.secret}


def upload(client: TestClient, key: str, name: str, purpose: str = "train") -> str:
    body = json.dumps(RECORD) + "\n"
    response = client.post("/v1/files", files={"file": (name, body * 20)}, data={"purpose": purpose},
                           headers=bearer(key))
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.fixture
def work(client: TestClient, keys: dict[str, str], store, tmp_path: Path) -> Work:
    alice = bearer(keys["alice"])
    train = upload(client, keys["alice"], "alice-p-train.jsonl")
    valid = upload(client, keys["alice"], "alice-p-valid.jsonl", "validation")
    job = client.post("/v1/jobs", json={"model": "tiny", "training_file": train, "validation_file": valid,
                                        "name": "alice-p-job", "hyperparameters": {"max_steps": 3}}, headers=alice)
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    assert job.json()["project"] == "team-p"
    oa_file = client.post(f"{OPENAI_PREFIX}/files", files={"file": ("alice-p-openai.jsonl", json.dumps(RECORD) * 1 + "\n")},
                          data={"purpose": "fine-tune"}, headers=alice)
    assert oa_file.status_code == 200, oa_file.text
    oa_job = client.post(f"{OPENAI_PREFIX}/fine_tuning/jobs", json={"model": "tiny", "training_file": train,
                                                                     "suffix": "alicep"}, headers=alice)
    assert oa_job.status_code == 200, oa_job.text
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with store.sessions() as session:
        session.add_all(StepMetric(job_id=job_id, step=s, loss=2.0 / s, lr=1e-4, tokens=100) for s in (1, 2))
        session.add(Checkpoint(job_id=job_id, step=2, path=str(ckpt), bytes=1, final=True))
        session.commit()
    for finished in (job_id, oa_job.json()["id"]):
        finish(store, finished)
    with store.sessions() as session:
        export, _ = exports.create_export(session, job_id, "merged", None, owner_id=None, model_type=None)
        session.commit()
        export_id = export.export_id
    results = client.get(f"{OPENAI_PREFIX}/fine_tuning/jobs/{oa_job.json()['id']}", headers=alice).json()["result_files"]
    evals = _alices_eval(client, alice, store)
    native_model = f"ft:tiny:alice:alice-p-job:{job_id}"  # /openai/v1/models: the jobs' and the checkpoint's names
    models = [native_model, f"{native_model}:ckpt-step-2", f"ft:tiny:alice:alicep:{oa_job.json()['id']}"]
    chat = client.post("/v1/sessions", json={"models": ["tiny"], "name": "alice-p-session"}, headers=alice)
    assert chat.status_code == 201, chat.text
    ids = {"session_id": [chat.json()["id"]], "job_id": [job_id, oa_job.json()["id"], *evals.pop("eval_job_id")],
           "file_id": [train, valid, oa_file.json()["id"], *results],
           "export_id": [export_id], "step": ["2"], "name": ["team-p"], "user": ["alice"], "model": models, **evals}
    secrets = [*ids["job_id"], *ids["file_id"], export_id, *evals["eval_id"], *evals["run_id"], "alice-p-eval",
               "alice-p-check", "alice", "team-p", SECRET_TEXT, "alice-p-job",
               "alice-p-train", "alice-p-valid", "alice-p-openai", "alicep", "alice-p-session"]
    return Work(ids, secrets)


def _alices_eval(client: TestClient, alice: dict[str, str], store) -> dict[str, list[str]]:
    """An eval, a run (its job finished by hand) and one graded line written where its job writes them."""
    from core.jobs.models import Job

    ev = client.post("/v1/evals", json={"name": "alice-p-eval", "data_source_config": {
        "type": "custom", "item_schema": {"type": "object", "properties": {"question": {"type": "string"}}}},
        "testing_criteria": [{"type": "string_check", "name": "alice-p-check", "input": "{{sample.output_text}}",
                              "reference": "{{item.question}}", "operation": "eq"}]}, headers=alice)
    assert ev.status_code == 200, ev.text
    run = client.post(f"/v1/evals/{ev.json()['id']}/runs", json=EVAL_RUN, headers=alice)
    assert run.status_code == 200, run.text
    with store.sessions() as session:
        parts = Path(session.get(Job, run.json()["job_id"]).output_dir) / "completions.parts"
    parts.mkdir(parents=True)
    line = {"index": 0, "messages": [{"role": "user", "content": SECRET_TEXT}], "item": {"question": SECRET_TEXT},
            "choices": [{"index": 0, "text": "no", "finish_reason": "stop", "tokens": 1}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}, "status": "fail",
            "results": [{"name": "alice-p-check", "type": "string_check", "score": 0.0, "passed": False}]}
    (parts / "rank-0.jsonl").write_text(json.dumps(line) + "\n")
    finish(store, run.json()["job_id"])  # a queued job's event stream would follow it forever
    item = f"outputitem_{run.json()['id'].removeprefix('evalrun_')}_0"
    return {"eval_id": [ev.json()["id"]], "run_id": [run.json()["id"]], "output_item_id": [item],
            "eval_job_id": [run.json()["job_id"]]}


@dataclass(frozen=True)
class Route:
    app: str
    method: str
    path: str
    """As the schema writes it, with ``{param}``s."""
    body_required: bool
    queries: dict[str, str]

    @property
    def params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.path)


def routes_with_ids(schema: dict[str, Any], app: str) -> Iterator[Route]:
    for path, operations in schema["paths"].items():
        if "{" not in path or path in EXCLUDED:
            continue
        for method, op in operations.items():
            if f"{method.upper()} {path}" in EXCLUDED:
                continue
            required = [p["name"] for p in op.get("parameters", []) if p["in"] == "query" and p.get("required")]
            missing = [name for name in required if name not in QUERIES]
            assert not missing, f"{method.upper()} {path}: give a value for its required query {missing} in QUERIES"
            yield Route(app, method.upper(), path, op.get("requestBody", {}).get("required", False),
                        {name: QUERIES[name] for name in required})


def all_routes(client: TestClient) -> list[Route]:
    native = client.get("/openapi.json").json()
    found = list(routes_with_ids(native, "native")) + list(routes_with_ids(create_openai_app().openapi(), "openai"))
    assert {r.path for r in found} >= {"/v1/jobs/{job_id}", "/files/{file_id}/content"}, "the schemas lost their routes"
    return found


def calls(route: Route, ids: dict[str, list[str]]) -> Iterator[dict[str, str]]:
    """Each way to fill the route's path with alice's ids (every job id, every file id)."""
    unknown = [p for p in route.params if p not in ids]
    assert not unknown, (f"{route.method} {route.path}: no value for {unknown}; add alice's ids for it to the work "
                         "fixture, or list the route in EXCLUDED with why it holds no project's data")
    combos: list[dict[str, str]] = [{}]
    for param in route.params:
        combos = [{**c, param: value} for c in combos for value in ids[param]]
    yield from combos


def send(client: TestClient, route: Route, values: dict[str, str], key: str):  # noqa: ANN201 - httpx.Response
    url = route.path.format(**values)
    if route.app == "openai":
        url = OPENAI_PREFIX + url
    body = BODIES.get((route.method, route.path))
    assert body is not None or not route.body_required, f"{route.method} {route.path}: add a valid body to BODIES"
    return client.request(route.method, url, params=route.queries, json=body, headers=bearer(key))


def masked(text: str, values: dict[str, str]) -> str:
    for value in sorted(values.values(), key=len, reverse=True):
        text = text.replace(value, "<id>")
    return text


def unknown_like(values: dict[str, str]) -> dict[str, str]:
    """Ids of the same shape that name nothing."""
    fresh = {}
    for param, value in values.items():
        if value.isdigit():
            fresh[param] = value
        elif value.startswith("file-results-"):
            fresh[param] = "file-results-" + new_id("job")
        else:
            fresh[param] = new_id(value.split("-")[0])
    return fresh


class TestAnotherProjectsIds:
    def test_every_route_with_an_id_answers_404_as_for_an_unknown_id(self, client: TestClient, keys: dict[str, str],
                                                                      work: Work) -> None:
        probed = 0
        for route in all_routes(client):
            for values in calls(route, work.ids):
                theirs = send(client, route, values, keys["bob"])
                what = f"{route.method} {route.path} with {values}"
                assert theirs.status_code == 404, f"{what}: {theirs.status_code} {theirs.text[:300]}"
                fresh = unknown_like(values)
                unknown = send(client, route, fresh, keys["bob"])
                assert masked(theirs.text, values) == masked(unknown.text, fresh), what
                leaked = [s for s in work.secrets if s in masked(theirs.text, values)]
                assert not leaked, f"{what}: the answer holds {leaked}: {theirs.text[:300]}"
                probed += 1
        assert probed >= 30

    def test_alice_reads_every_route_bob_cannot(self, client: TestClient, keys: dict[str, str], work: Work) -> None:
        """The ids are real: each read answers alice other than an unknown id (so bob's 404 is the check's)."""
        for route in all_routes(client):
            if route.method != "GET":
                continue
            for values in calls(route, work.ids):
                mine = send(client, route, values, keys["alice"])
                unknown = send(client, route, unknown_like(values), keys["alice"])
                assert masked(mine.text, values) != masked(unknown.text, unknown_like(values)) or mine.status_code != 404, (
                    f"{route.path} with {values}: alice got {mine.status_code} {mine.text[:200]}")

    def test_bobs_requests_changed_nothing_of_alices(self, client: TestClient, keys: dict[str, str], work: Work) -> None:
        for route in all_routes(client):
            if route.method != "GET":
                for values in calls(route, work.ids):
                    send(client, route, values, keys["bob"])
        alice = bearer(keys["alice"])
        for file_id in work.ids["file_id"][:2]:
            assert client.get(f"/v1/files/{file_id}", headers=alice).status_code == 200
        for job_id in work.ids["job_id"]:
            assert client.get(f"/v1/jobs/{job_id}", headers=alice).json()["status"] == "succeeded"
        assert client.get("/v1/jobs", params={"q": "clone"}, headers=alice).json()["data"] == []


class TestListsAndCreates:
    def test_lists_show_only_the_callers_projects(self, client: TestClient, keys: dict[str, str], work: Work) -> None:
        bob = bearer(keys["bob"])
        for url in ("/v1/jobs", "/v1/files", f"{OPENAI_PREFIX}/files", f"{OPENAI_PREFIX}/fine_tuning/jobs", "/v1/sessions"):
            response = client.get(url, headers=bob)
            assert response.status_code == 200 and response.json()["data"] == [], url
            assert not [s for s in work.secrets if s in response.text], url
        for url in ("/v1/jobs", "/v1/files"):
            refused = client.get(url, params={"project": "team-p"}, headers=bob)
            assert refused.status_code == 404 and refused.json()["error"]["param"] == "project"
        alice = client.get("/v1/jobs", params={"project": "team-p"}, headers=bearer(keys["alice"])).json()["data"]
        assert {j["id"] for j in alice} == set(work.ids["job_id"]) and {j["project"] for j in alice} == {"team-p"}
        everyone = client.get("/v1/jobs").json()["data"]  # the global admin sees every project
        assert set(work.ids["job_id"]) <= {j["id"] for j in everyone}

    def test_creates_go_to_a_project_of_the_callers_only(self, client: TestClient, keys: dict[str, str],
                                                          work: Work) -> None:
        bob = bearer(keys["bob"])
        refused = client.post("/v1/files", files={"file": ("b.jsonl", json.dumps(RECORD) + "\n")},
                              data={"purpose": "train", "project": "team-p"}, headers=bob)
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "project", refused.text
        job = client.post("/v1/jobs", json={"model": "tiny", "training_file": work.ids["file_id"][0]}, headers=bob)
        assert job.status_code == 422 and job.json()["error"]["param"] == "training_file", job.text
        assert "no file" in job.text and "alice" not in job.text
        into_p = client.post("/v1/jobs", json={"model": "tiny", "training_file": work.ids["file_id"][0],
                                               "project": "team-p"}, headers=bob)
        assert into_p.status_code == 404 and into_p.json()["error"]["param"] == "project", into_p.text

    def test_a_file_of_another_project_of_ones_own_is_not_used(self, client: TestClient, keys: dict[str, str],
                                                                store, work: Work) -> None:
        with store.sessions() as session:
            user = session.scalars(projects.select(projects.User).where(projects.User.name == "alice")).one()
            projects.add_member(session, projects.find_project(session, "team-q"), user)
            session.commit()
        alice = bearer(keys["alice"])
        job = client.post("/v1/jobs", json={"model": "tiny", "training_file": work.ids["file_id"][0],
                                            "project": "team-q"}, headers=alice)
        assert job.status_code == 422 and job.json()["error"]["param"] == "training_file", job.text


class TestOpenAIProjectHeader:
    def test_the_header_selects_the_project_and_a_foreign_one_is_refused(self, client: TestClient,
                                                                        keys: dict[str, str], work: Work) -> None:
        alice, bob = bearer(keys["alice"]), bearer(keys["bob"])
        url = f"{OPENAI_PREFIX}/fine_tuning/jobs"
        listed = client.get(url, headers={**alice, "OpenAI-Project": "team-p"}).json()["data"]
        # the native job too (one store); the eval run's job (the third) is no fine-tuning job
        assert {j["id"] for j in listed} == set(work.ids["job_id"][:2])
        for who, project in ((bob, "team-p"), (alice, "no-such-project"), (alice, "team-q")):
            refused = client.get(url, headers={**who, "OpenAI-Project": project})
            assert refused.status_code == 404, refused.text
            error = refused.json()["error"]
            assert error["param"] == "OpenAI-Project" and set(error) == {"message", "type", "param", "code"}
            assert "OpenAI-Project" in error["message"] and work.ids["job_id"][1] not in refused.text


class TestSharedViews:
    def test_the_queue_shows_another_projects_job_by_its_project_alone(self, client: TestClient,
                                                                       keys: dict[str, str], work: Work) -> None:
        alice, bob = bearer(keys["alice"]), bearer(keys["bob"])
        # Alice's session waits in the queue too (it is placed like a job); ended here, at once while queued.
        assert client.delete(f"/v1/sessions/{work.ids['session_id'][0]}", headers=alice).status_code == 200
        queued = client.post("/v1/jobs", json={"model": "tiny", "training_file": work.ids["file_id"][0],
                                               "name": "alice-p-job"}, headers=alice).json()
        [theirs] = client.get("/v1/queue", headers=bob).json()["data"]
        assert (theirs["id"], theirs["name"], theirs["owner"], theirs["model"], theirs["project"]) == (
            None, None, None, None, "team-p")
        assert queued["id"] not in client.get("/v1/queue", headers=bob).text
        [mine] = client.get("/v1/queue", headers=alice).json()["data"]
        assert (mine["id"], mine["project"]) == (queued["id"], "team-p")


class TestKeyDefaults:
    def test_a_keys_project_is_where_its_work_goes_and_what_openai_shows(self, client: TestClient, store,
                                                                         keys: dict[str, str], work: Work) -> None:
        with store.sessions() as session:
            alice_user = session.scalars(projects.select(projects.User).where(projects.User.name == "alice")).one()
            projects.add_member(session, projects.find_project(session, "team-q"), alice_user)
            session.commit()
        alice = bearer(keys["alice"])
        refused = client.post("/v1/users/bob/keys", json={"project": "team-p"})  # bob is not in team-p
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "project"
        issued = client.post("/v1/users/me/keys", json={"name": "q-key", "project": "team-q"}, headers=alice)
        assert issued.status_code == 201, issued.text
        q_key = bearer(issued.json()["api_key"])
        stored = client.post("/v1/files", files={"file": ("q.jsonl", json.dumps(RECORD) + "\n")},
                             data={"purpose": "train"}, headers=q_key)
        assert stored.json()["project"] == "team-q"
        listed = client.get(f"{OPENAI_PREFIX}/files", headers=q_key).json()["data"]
        assert [f["id"] for f in listed] == [stored.json()["id"]]  # team-p's files are not in team-q's view
        job = client.post(f"{OPENAI_PREFIX}/fine_tuning/jobs", json={"model": "tiny", "training_file": stored.json()["id"]},
                          headers={**alice, "OpenAI-Project": "team-q"})
        assert job.status_code == 200, job.text
        assert client.get(f"/v1/jobs/{job.json()['id']}", headers=alice).json()["project"] == "team-q"
