"""``/v1/projects``: global admins create projects and set quotas; project admins manage members;
everyone sees only the projects they are in (another one is 404, as unknown)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.integration.helpers import bearer

pytestmark = pytest.mark.integration


def new_user(client: TestClient, name: str, projects: list[str] | None = None) -> dict[str, str]:
    body = {"name": name, **({"projects": projects} if projects else {})}
    response = client.post("/v1/users", json=body)
    assert response.status_code == 201, response.text
    return bearer(response.json()["api_key"])


class TestProjects:
    def test_admin_creates_a_project_and_a_user_in_it(self, client: TestClient) -> None:
        created = client.post("/v1/projects", json={"name": "vision", "max_gpus": 4, "max_priority": "normal"})
        assert created.status_code == 201, created.text
        assert {k: created.json()[k] for k in ("name", "max_gpus", "max_priority")} == {
            "name": "vision", "max_gpus": 4, "max_priority": "normal"}
        carol = new_user(client, "carol", ["vision"])
        mine = client.get("/v1/projects", headers=carol).json()["data"]
        assert [(p["name"], p["role"], p["default"]) for p in mine] == [("vision", "member", True)]
        assert {p["name"] for p in client.get("/v1/projects").json()["data"]} >= {"default", "vision"}
        assert client.post("/v1/projects", json={"name": "vision"}).status_code == 409
        bad = client.post("/v1/users", json={"name": "dave", "projects": ["no-such"]})
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "project"

    def test_a_new_user_joins_default_unless_told(self, client: TestClient) -> None:
        erin = new_user(client, "erin")
        assert [p["name"] for p in client.get("/v1/projects", headers=erin).json()["data"]] == ["default"]

    def test_only_global_admins_create_or_change_projects(self, client: TestClient) -> None:
        client.post("/v1/projects", json={"name": "nlp"})
        frank = new_user(client, "frank", ["nlp"])
        assert client.post("/v1/projects", json={"name": "mine"}, headers=frank).status_code == 403
        assert client.patch("/v1/projects/nlp", json={"max_gpus": 64}, headers=frank).status_code == 403
        patched = client.patch("/v1/projects/nlp", json={"max_gpus": 2})
        assert patched.json()["max_gpus"] == 2
        assert client.patch("/v1/projects/nlp", json={"max_gpus": None}).json()["max_gpus"] is None
        assert client.patch("/v1/projects/nlp", json={"max_priority": "urgent"}).status_code == 422

    def test_project_admins_manage_members_members_do_not(self, client: TestClient) -> None:
        client.post("/v1/projects", json={"name": "nlp"})
        lead, dev = new_user(client, "lead", ["nlp"]), new_user(client, "dev", ["nlp"])
        new_user(client, "newbie")
        assert client.put("/v1/projects/nlp/members/lead", json={"role": "admin"}).status_code == 200
        refused = client.put("/v1/projects/nlp/members/newbie", headers=dev)
        assert refused.status_code == 403 and "admin of project 'nlp'" in refused.json()["error"]["message"]
        assert client.put("/v1/projects/nlp/members/newbie", headers=lead).json() == {
            "object": "project.member", "user": "newbie", "role": "member"}
        members = client.get("/v1/projects/nlp/members", headers=dev).json()["data"]
        assert {(m["user"], m["role"]) for m in members} == {("lead", "admin"), ("dev", "member"), ("newbie", "member")}
        assert client.delete("/v1/projects/nlp/members/newbie", headers=lead).status_code == 204
        assert client.delete("/v1/projects/nlp/members/newbie", headers=lead).status_code == 404

    def test_a_project_one_is_not_in_is_404_as_unknown(self, client: TestClient) -> None:
        client.post("/v1/projects", json={"name": "secret-team"})
        outsider = new_user(client, "outsider")
        for method, url in (("GET", "/v1/projects/secret-team"), ("GET", "/v1/projects/secret-team/members"),
                            ("PUT", "/v1/projects/secret-team/members/outsider"), ("PUT", "/v1/projects/secret-team/default")):
            theirs = client.request(method, url, headers=outsider)
            unknown = client.request(method, url.replace("secret-team", "no-such-team"), headers=outsider)
            assert theirs.status_code == unknown.status_code == 404, (url, theirs.text)
            assert theirs.text.replace("secret-team", "X") == unknown.text.replace("no-such-team", "X")

    def test_the_default_project_moves(self, client: TestClient) -> None:
        client.post("/v1/projects", json={"name": "second"})
        gina = new_user(client, "gina", ["default", "second"])
        assert client.put("/v1/projects/second/default", headers=gina).json()["default"] is True
        defaults = {p["name"]: p["default"] for p in client.get("/v1/projects", headers=gina).json()["data"]}
        assert defaults == {"default": False, "second": True}


class TestProjectAdminsActOnTheProjectsWork:
    """A project admin cancels and exports members' jobs and deletes members' files in their
    project; a plain member may not (403 naming the owner); an admin of another project cannot
    even see them (404)."""

    def test_cancel_export_and_delete(self, client: TestClient, store, settings) -> None:
        from core.jobs import service
        from core.jobs.states import JobStatus
        from tests.integration.helpers import CHAT_RECORD, spec

        client.post("/v1/projects", json={"name": "speech"})
        client.post("/v1/projects", json={"name": "other"})
        lead, dev, peer = (new_user(client, n, ["speech"]) for n in ("lead", "dev", "peer"))
        outsider = new_user(client, "outsider", ["other"])
        assert client.put("/v1/projects/speech/members/lead", json={"role": "admin"}).status_code == 200
        assert client.put("/v1/projects/other/members/outsider", json={"role": "admin"}).status_code == 200
        body = (__import__("json").dumps(CHAT_RECORD) + "\n").encode()
        uploaded = client.post("/v1/files", files={"file": ("d.jsonl", body)}, data={"purpose": "train"}, headers=dev)
        assert uploaded.status_code == 201, uploaded.text
        file_id = uploaded.json()["id"]
        job = client.post("/v1/jobs", json=spec(file_id), headers=dev)
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]

        refused = client.post(f"/v1/jobs/{job_id}/cancel", headers=peer)
        assert refused.status_code == 403, refused.text
        assert "belongs to 'dev'" in refused.json()["error"]["message"]
        assert "an admin of its project" in refused.json()["error"]["message"]
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=outsider).status_code == 404
        assert client.delete(f"/v1/files/{file_id}", headers=outsider).status_code == 404
        assert client.delete(f"/v1/files/{file_id}", headers=peer).status_code == 403

        done = client.post("/v1/jobs", json=spec(file_id), headers=dev).json()["id"]
        with store.sessions() as session:
            assert service.transition(session, done, JobStatus.running, output_dir=str(settings.jobs_dir / done))
            assert service.transition(session, done, JobStatus.succeeded)
            session.commit()
        assert client.post(f"/v1/jobs/{done}/exports", json={"format": "merged"}, headers=peer).status_code == 403
        exported = client.post(f"/v1/jobs/{done}/exports", json={"format": "merged"}, headers=lead)
        assert exported.status_code == 202 and exported.json()["status"] == "queued", exported.text

        cancelled = client.post(f"/v1/jobs/{job_id}/cancel", headers=lead)
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert client.delete(f"/v1/files/{file_id}", headers=lead).status_code == 200
        assert client.get(f"/v1/files/{file_id}", headers=dev).status_code == 404
