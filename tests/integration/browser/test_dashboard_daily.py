"""Daily use on the dashboard, in headless Chromium: compare runs, search and the phone-width jobs
list, re-run and resume buttons, a failure's folded detail, the form's defaults from the API.

The runs are jobs of 4 GPUs placed on a 4-GPU host written into the store (``gpu_host``), which no
worker serves, so the stack's own CPU worker never takes them; their steps, checkpoints and end are
written into the store as a worker would write them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import MODEL, screenshot_dir

pytestmark = [pytest.mark.integration, pytest.mark.browser]


def a_run(api: httpx.Client, store: Any, chat_file: Path, name: str, lr: float, losses: list[float],
          status: str = "succeeded", error: str | None = None, checkpoints: tuple[int, ...] = (),
          evals: dict[int, float] | None = None) -> dict[str, Any]:
    """A finished 4-GPU job with a step row per loss (tokens 1000 a step) and ``evals`` (step: eval
    loss), written as its worker would."""
    from core.jobs.models import Checkpoint, EvalMetric, Job, StepMetric
    from core.jobs.service import transition
    from core.jobs.states import JobStatus
    from core.jobs.summary import summarize
    from trainer.training import layout

    with chat_file.open("rb") as fh:
        file_id = api.post("/v1/files", data={"purpose": "train"}, files={"file": (chat_file.name, fh)}).json()["id"]
    body = {"name": name, "model": MODEL, "training_file": file_id, "gpus": 4, "lora": {"r": 4},
            "hyperparameters": {"max_steps": len(losses), "learning_rate": lr, "batch_tokens": 256, "max_seq_len": 128}}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    job = response.json()
    with store.begin() as session:
        transition(session, job["id"], JobStatus.running)
        for step, loss in enumerate(losses, 1):
            session.add(StepMetric(job_id=job["id"], step=step, loss=loss, lr=lr * (1 - step / (len(losses) + 1)),
                                   grad_norm=1.0 / step, tokens=1000))
        for step, loss in (evals or {}).items():
            session.add(EvalMetric(job_id=job["id"], step=step, loss=loss, tokens=500))
        output_dir = session.get(Job, job["id"]).output_dir
        for step in checkpoints:
            path = layout.checkpoint_dir(output_dir, step)
            path.mkdir(parents=True)
            (path / "trainer_state.json").write_text("{}")
            session.add(Checkpoint(job_id=job["id"], step=step, path=str(path), bytes=2, final=False))
        session.flush()
        transition(session, job["id"], JobStatus(status), progress_step=len(losses), summary=summarize(session, job["id"]),
                   **({"error_code": "model_not_found", "error_message": error} if error else {}))
    return api.get(f"/v1/jobs/{job['id']}").json()


def test_compare_two_runs_by_step_and_tokens_with_their_differences(
    page: Any, api: httpx.Client, store: Any, gpu_host: str, chat_file: Path, no_leftover_jobs: None
) -> None:
    fast = a_run(api, store, chat_file, "cmp-fast", 1e-3, [3.0, 2.0, 1.5, 1.2], evals={2: 2.1, 4: 1.4})
    slow = a_run(api, store, chat_file, "cmp-slow", 1e-4, [3.0, 2.8, 2.6, 2.5], evals={2: 2.9, 4: 2.6})
    page.goto("/#/jobs")
    page.get_by_label("Search").fill("cmp-")
    page.wait_for_function("() => location.hash.includes('q=cmp-')")  # the search is kept in the address
    rows = page.get_by_test_id("job-row")
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=job-row]')].length === 2")
    assert {r.get_attribute("data-job-id") for r in rows.all()} == {fast["id"], slow["id"]}
    assert page.get_by_label("Search").evaluate("el => el === document.activeElement")  # still typing there
    for row in rows.all():
        row.get_by_test_id("job-pick").check()
    page.get_by_test_id("compare-button").click()

    page.wait_for_url("**/#/compare?ids=*")
    page.wait_for_function("() => ['loss', 'lr', 'grad'].every((k) =>"
                           " document.querySelector(`[data-testid=chart-compare-${k}]`)?.dataset.points === '4')"
                           " && document.querySelector('[data-testid=chart-compare-eval]')?.dataset.points === '2'")
    legend = page.get_by_test_id("chart-compare-loss-legend").inner_text()
    assert "cmp-fast" in legend and "cmp-slow" in legend

    page.get_by_label("x axis").select_option("tokens")
    page.wait_for_function("() => { const c = document.querySelector('[data-testid=chart-compare-loss]');"
                           " return c?.dataset.x === 'tokens' && c.dataset.points === '4'; }")  # 1000 ... 4000 tokens
    page.get_by_label("log scale").check()
    page.get_by_text("Train loss (log scale)").wait_for()
    page.get_by_label("Smoothing").fill("0.6")

    finals = page.locator("[data-testid=compare-params] tr.result").first.locator("td").all_inner_texts()
    assert sorted(finals) == ["1.2000", "2.5000"]  # each job's final train loss, from its summary
    best_eval = page.locator("[data-testid=compare-params] tr.result").nth(1).locator("td").all_inner_texts()
    assert sorted(best_eval) == ["1.4000", "2.6000"]
    lr_row = page.locator("[data-testid=compare-param][data-key='hyperparameters.learning_rate']")
    assert lr_row.get_attribute("data-differs") == "true"
    assert page.locator("[data-testid=compare-param][data-key='lora.r']").get_attribute("data-differs") == "false"
    differing = page.locator("[data-testid=compare-param][data-differs=true]").evaluate_all("els => els.map(e => e.dataset.key)")
    assert differing == ["hyperparameters.learning_rate"]  # the same dataset: its second upload is the first file
    assert page.get_by_test_id("compare-differing").inner_text() == "1 setting differs (highlighted)."
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-compare.png"), full_page=True)


def test_the_jobs_list_fits_a_phone_and_searches_by_model_and_owner(
    page_as: Callable[..., Any], dashboard_stack: Any, api: httpx.Client, store: Any, gpu_host: str, chat_file: Path,
    no_leftover_jobs: None,
) -> None:
    run = a_run(api, store, chat_file, "phone-run", 2e-4, [2.0, 1.0])
    page = page_as(dashboard_stack.api_key, width=375, height=800)
    page.goto("/#/jobs?q=phone-run")
    row = page.locator(f"[data-testid=job-row][data-job-id='{run['id']}']")
    row.wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    box = row.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 375
    assert row.get_by_role("link", name="phone-run").is_visible()
    assert row.get_by_test_id("job-loss").inner_text() == "1.0000"  # from the job's summary
    assert row.get_by_test_id("job-best-loss").inner_text() == "1.0000 (train)"  # no validation set
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-jobs-phone.png"), full_page=True)
    for text in (MODEL, "admin"):
        page.goto(f"/#/jobs?q={text}")
        page.locator(f"[data-testid=job-row][data-job-id='{run['id']}']").wait_for()
    page.goto("/#/jobs?q=no-such-job-anywhere")
    page.get_by_text("No jobs match these filters.").wait_for()


def test_a_failed_job_folds_its_detail_and_resumes_or_reruns_as_new_jobs(
    page: Any, api: httpx.Client, store: Any, gpu_host: str, chat_file: Path, no_leftover_jobs: None
) -> None:
    error = ("model 'x' is not under the model root; copy it there or name a hub id\n"
             "--- last 2 lines of the trainer's stderr ---\nTraceback (most recent call last):\nOSError: x")
    failed = a_run(api, store, chat_file, "to-resume", 2e-4, [2.0, 1.8, 1.7], status="failed", error=error,
                   checkpoints=(1, 2))
    page.goto(f"/#/jobs/{failed['id']}")
    box = page.get_by_test_id("job-error")
    box.wait_for()
    assert box.inner_text().startswith("model_not_found: model 'x' is not under the model root")
    detail = page.get_by_test_id("job-error-detail")
    assert detail.get_attribute("open") is None and not page.get_by_text("OSError: x").is_visible()
    assert page.get_by_test_id("job-error-download").get_attribute("download") == f"{failed['id']}-error.txt"
    assert page.get_by_test_id("download-metrics").get_attribute("href") == f"/v1/jobs/{failed['id']}/metrics.csv"

    page.get_by_test_id("resume-step").select_option("1")
    page.get_by_role("button", name="Resume from").click()
    page.wait_for_url(lambda url: "#/jobs/job-" in url and failed["id"] not in url)
    resumed = page.url.rsplit("/", 1)[1]
    assert [c["step"] for c in api.get(f"/v1/jobs/{resumed}/checkpoints").json()["data"]] == [1]

    page.goto(f"/#/jobs/{failed['id']}")
    page.get_by_role("button", name="Re-run…").click()
    page.get_by_label("Changes (JSON)").fill('{"hyperparameters": {"learning_rate": 5}}')
    page.get_by_role("button", name="Submit the copy").click()
    page.get_by_test_id("rerun-error").filter(has_text="hyperparameters.learning_rate").wait_for()
    page.get_by_label("Changes (JSON)").fill('{"name": "again", "hyperparameters": {"learning_rate": 0.0001}}')
    page.get_by_role("button", name="Submit the copy").click()
    page.wait_for_url(lambda url: "#/jobs/job-" in url and failed["id"] not in url)
    again = api.get(f"/v1/jobs/{page.url.rsplit('/', 1)[1]}").json()
    assert again["name"] == "again" and again["spec"]["hyperparameters"]["learning_rate"] == 0.0001


def test_the_form_shows_the_apis_defaults_as_placeholders(page: Any, api: httpx.Client) -> None:
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    page.goto("/#/new")
    warmup = page.get_by_label("Warm-up steps")
    page.wait_for_function("() => document.querySelector('[data-param=\"lora.alpha\"]')?.placeholder")
    assert warmup.input_value() == "" and warmup.get_attribute("placeholder") == str(
        schemas["Hyperparameters"]["properties"]["warmup_steps"]["default"])
    assert page.get_by_label("LoRA alpha").get_attribute("placeholder") == str(schemas["LoraSpec"]["properties"]["alpha"]["default"])
    assert page.get_by_label("Checkpoint every (steps)").get_attribute("placeholder") == str(
        schemas["JobSpec"]["properties"]["checkpoint_every"]["default"])
    assert page.get_by_label("Learning rate").get_attribute("placeholder") == "0.0002"
