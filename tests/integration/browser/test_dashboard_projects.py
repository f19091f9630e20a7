"""The project switcher in headless Chromium: a user in two projects picks one in the header; the
jobs list shows only its jobs, a job made on the new-job page (and its upload) goes to it, and the
GPUs page shows which project holds each GPU (another project's job by its project alone).

Users, projects and jobs are made through the API; two 2-GPU jobs are claimed on a fake 4-GPU host
written into the store (``gpu_host``, as test_dashboard_gpus.py does), one of the user's project,
one of a project they are not in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import GPU_HOST, MODEL, cancel_in_store, screenshot_dir

pytestmark = [pytest.mark.integration, pytest.mark.browser]


def submit_job(client: httpx.Client, chat_file: Path, name: str, project: str | None = None) -> dict[str, Any]:
    """A 2-GPU job (no CPU worker claims it) and its upload, in ``project`` (None: the user's default)."""
    where = {"project": project} if project else {}
    with chat_file.open("rb") as fh:
        upload = client.post("/v1/files", data={"purpose": "train", **where}, files={"file": (chat_file.name, fh)})
    assert upload.status_code == 201, upload.text
    body = {"name": name, "model": MODEL, "training_file": upload.json()["id"], "gpus": 2,
            "hyperparameters": {"max_steps": 50, "batch_tokens": 256, "max_seq_len": 128}, **where}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def user_in(api: httpx.Client, name: str, projects: list[str]) -> str:
    for project in projects:
        api.post("/v1/projects", json={"name": project})  # 409 once made: the module's tests share the stack
    made = api.post("/v1/users", json={"name": name, "projects": projects})
    if made.status_code == 409:  # made by an earlier test of the module: a new key
        made = api.post(f"/v1/users/{name}/keys", json={"name": "again"})
    assert made.status_code == 201, made.text
    return made.json()["api_key"]


@pytest.fixture
def pat(api: httpx.Client, dashboard_stack: Any) -> Iterator[httpx.Client]:
    """pat, a member of projects vision and speech (vision the default)."""
    key = user_in(api, "pat", ["vision", "speech"])
    with dashboard_stack.client(headers={"Authorization": f"Bearer {key}"}) as client:
        client.key = key  # type: ignore[attr-defined]
        yield client


@pytest.fixture
def olga(api: httpx.Client, dashboard_stack: Any) -> Iterator[httpx.Client]:
    """olga, in project audio only."""
    key = user_in(api, "olga", ["audio"])
    with dashboard_stack.client(headers={"Authorization": f"Bearer {key}"}) as client:
        yield client


def claim(store: Any, job_id: str, slots: tuple[int, ...]) -> None:
    import datetime as dt

    from core.db import utcnow
    from core.jobs import scheduling
    from core.jobs.placement import Placement
    from core.settings import Settings

    # The job's heartbeat set ahead, as the host's is: the stack's reaper would otherwise requeue it
    # (freeing its GPUs) once the heartbeat timeout passed on a slow box, before the page is read.
    with store() as session:
        assert scheduling.try_claim(session, Placement(job_id, GPU_HOST, slots), Settings(max_running_jobs_per_user=0),
                                    values={"worker_id": GPU_HOST, "attempts": 1,
                                            "heartbeat_at": utcnow() + dt.timedelta(minutes=10)})
        session.commit()


def test_the_switcher_filters_the_jobs_and_new_jobs_go_to_the_selected_project(
    page_as: Callable[..., Any], pat: httpx.Client, chat_file: Path, gpu_host: str, no_leftover_jobs: None
) -> None:
    speech = submit_job(pat, chat_file, "speech-job", "speech")
    vision = submit_job(pat, chat_file, "vision-job", "vision")
    page = page_as(pat.key)  # type: ignore[attr-defined]
    page.goto("/#/jobs")
    switcher = page.get_by_test_id("project-switcher")
    switcher.wait_for()
    options = [o.inner_text() for o in switcher.locator("option").all()]
    assert options == ["All my projects (new work: vision)", "speech", "vision"]
    for job in (speech, vision):
        page.locator(f"[data-testid=job-row][data-job-id='{job['id']}']").wait_for()

    switcher.select_option("speech")
    page.wait_for_function("() => localStorage.getItem('ftq.project') === 'speech'")
    page.locator(f"[data-testid=job-row][data-job-id='{vision['id']}']").wait_for(state="detached")
    page.locator(f"[data-testid=job-row][data-job-id='{speech['id']}']").wait_for()
    assert page.locator(f"[data-testid=job-row][data-job-id='{vision['id']}']").count() == 0

    page.get_by_test_id("nav-new").click()
    page.get_by_test_id("new-project").filter(has_text="go to project speech").wait_for()
    page.get_by_label("Base model").select_option("tiny-llama")
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(chat_file))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    page.get_by_label("Job name (optional)").fill("made-in-speech")
    page.get_by_label("Train for").fill("20")
    page.get_by_label("Tokens per batch").fill("256")
    page.get_by_label("Max sequence length").fill("128")
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url("**/#/jobs/job-*")
    made = pat.get(f"/v1/jobs/{page.url.rsplit('/', 1)[1]}").json()
    assert (made["name"], made["project"]) == ("made-in-speech", "speech")
    assert pat.get(f"/v1/files/{made['training_file']}").json()["project"] == "speech"
    if shots := screenshot_dir():
        page.goto("/#/jobs")
        page.locator(f"[data-testid=job-row][data-job-id='{made['id']}']").wait_for()
        page.screenshot(path=str(shots / "dashboard-project-switcher.png"), full_page=True)


def test_the_gpus_page_shows_which_project_holds_each_gpu(
    page_as: Callable[..., Any], pat: httpx.Client, olga: httpx.Client, chat_file: Path, store: Any,
    gpu_host: str, no_leftover_jobs: None
) -> None:
    mine = submit_job(pat, chat_file, "pats-vision-job", "vision")
    theirs = submit_job(olga, chat_file, "olgas-secret-job")
    claim(store, mine["id"], (0, 1))
    claim(store, theirs["id"], (2, 3))
    try:
        page = page_as(pat.key)  # type: ignore[attr-defined]
        page.goto("/#/gpus")
        card = page.locator(f"[data-testid=worker-card][data-worker-id='{GPU_HOST}']")
        card.get_by_test_id("gpu-slot").nth(3).wait_for()
        slots = card.get_by_test_id("gpu-slot").all()
        assert [s.get_attribute("data-project") for s in slots] == ["vision", "vision", "audio", "audio"]
        assert [s.get_attribute("data-job-id") for s in slots] == [mine["id"], mine["id"], "", ""]
        assert "another project's job" in slots[2].inner_text() and "project audio" in slots[2].inner_text()
        assert theirs["id"] not in page.content() and "olgas-secret-job" not in page.content()
        if shots := screenshot_dir():
            page.screenshot(path=str(shots / "dashboard-gpus-projects.png"), full_page=True)
    finally:
        cancel_in_store(store, mine["id"])
        cancel_in_store(store, theirs["id"])
