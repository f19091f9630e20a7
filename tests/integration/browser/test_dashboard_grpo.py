"""GRPO on the dashboard, in headless Chromium: a job's rollouts by step (view-job-rollouts.js) and
the compare page's reward curves and eval scores (view-compare.js).

The runs are GRPO jobs of 4 GPUs placed on the 4-GPU host written into the store (``gpu_host``),
which no worker serves, so the stack's CPU worker never trains them: their step rows (with the
reward fields) and shown rollouts are written into the store as the worker's recorder writes them
(``worker.recorder.apply_events``, the trainer's ``step`` and ``rollouts`` events). An eval's runs
on base and tuned are jobs the stack's one worker would run: the compare test serves their
comparison (``GET /v1/jobs/{id}/evals``, checked at the API in tests/integration/test_api_evals.py)
through Playwright's routing, and the page draws what it is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import MODEL, screenshot_dir

pytestmark = [pytest.mark.integration, pytest.mark.browser]

PROMPTS = [{"prompt": "2 + 2 =", "answer": "4"}, {"prompt": "3 + 4 =", "answer": "7"}]
GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
          "operation": "eq"}
EVAL_ITEMS = [{"item": {"q": "one", "a": "1"}}, {"item": {"q": "two", "a": "2"}}]


def step_events(step: int, reward: float, shown: int = 2) -> list[dict[str, Any]]:
    """The trainer's ``step`` event with GRPO's fields, then its ``rollouts`` event (``shown`` of them)."""
    from trainer.events import STEP_FIELDS, make_event

    fields = {name: None for name in STEP_FIELDS}
    fields.update(step=step, total_steps=10, epoch=step / 10, loss=0.01, lr=1e-5, grad_norm=0.5, tokens=1000,
                  sequences=2, reward_mean=reward, reward_std=0.2, zero_std_fraction=0.0, completion_length=3.0,
                  clip_fraction=0.0, grade_error_fraction=0.0)
    rollouts = [{"prompt_index": k % 2, "prompt": PROMPTS[k % 2]["prompt"], "completion": f" answer {step}-{k}",
                 "completion_tokens": 3, "reward": float(k == 0), "advantage": 0.5 if k == 0 else -0.5,
                 "scores": {"exact": float(k == 0)}} for k in range(shown)]
    return [make_event("step", **fields), make_event("rollouts", step=step, rollouts=rollouts)]


def a_grpo_run(api: httpx.Client, store: Any, prompts: Path, name: str, rewards: list[float], *,
               status: str = "running", evals: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A 4-GPU GRPO job with a step per reward and its rollouts, written as its worker would."""
    from core.jobs.service import transition
    from core.jobs.states import JobStatus
    from worker.recorder import apply_events

    with prompts.open("rb") as fh:
        upload = api.post("/v1/files", data={"purpose": "train", "format": "prompts"}, files={"file": (prompts.name, fh)})
    assert upload.status_code == 201, upload.text
    body = {"name": name, "model": MODEL, "training_file": upload.json()["id"], "gpus": 4, "objective": "grpo",
            "lora": {"r": 4}, "grpo": {"graders": GRADER, "group_size": 2, "max_new_tokens": 8},
            "hyperparameters": {"max_steps": 10, "batch_tokens": 256}, **({"evals": evals} if evals else {})}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    job = response.json()
    with store.begin() as session:
        transition(session, job["id"], JobStatus.running)
        apply_events(session, job["id"], [e for step, r in enumerate(rewards, 1) for e in step_events(step, r)])
        if status != "running":
            transition(session, job["id"], JobStatus(status), progress_step=len(rewards))
    return api.get(f"/v1/jobs/{job['id']}").json()


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def rows(page: Any) -> list[str]:
    return page.get_by_test_id("rollout-completion").all_inner_texts()


def test_a_grpo_jobs_page_shows_each_steps_rollouts_and_the_newest_live(
    page: Any, api: httpx.Client, store: Any, gpu_host: str, prompts_file: Path, no_leftover_jobs: None
) -> None:
    from worker.recorder import apply_events

    job = a_grpo_run(api, store, prompts_file, "grpo-rollouts", [0.1, 0.4, 0.7])
    page.goto(f"/#/jobs/{job['id']}")
    page.locator("main[data-history-loaded=true]").wait_for()
    section = page.get_by_test_id("job-rollouts")
    section.wait_for()
    page.wait_for_function("() => document.querySelectorAll('[data-testid=rollout-row]').length === 2")
    steps = page.get_by_test_id("rollouts-step")
    assert steps.locator("option").all_inner_texts() == ["step 1", "step 2", "step 3"]
    assert steps.input_value() == "3"  # the newest step first
    assert rows(page) == ["answer 3-0", "answer 3-1"]
    assert page.get_by_test_id("rollout-reward").all_inner_texts() == ["1", "0"]
    assert page.get_by_test_id("rollout-scores").first.inner_text() == "exact 1"
    assert "mean reward 0.5" in page.get_by_test_id("rollouts-caption").inner_text()
    assert page.get_by_test_id("chart-grpo-reward").is_visible()

    steps.select_option("1")
    page.wait_for_function("() => document.querySelector('[data-testid=rollout-completion]')?.textContent.includes('1-0')")
    assert rows(page) == ["answer 1-0", "answer 1-1"]

    steps.select_option("3")  # back on the newest: follow what comes
    page.wait_for_function("() => document.querySelector('[data-testid=rollout-completion]')?.textContent.includes('3-0')")
    with store.begin() as session:
        apply_events(session, job["id"], step_events(4, 0.9, shown=3))
    page.wait_for_function("() => document.querySelectorAll('[data-testid=rollout-row]').length === 3")
    assert steps.input_value() == "4" and rows(page) == ["answer 4-0", "answer 4-1", "answer 4-2"]
    if shots := screenshot_dir():
        section.screenshot(path=str(shots / "dashboard-grpo-rollouts.png"))


def test_rollouts_wait_for_the_first_step_and_other_objectives_show_none(
    page: Any, api: httpx.Client, store: Any, gpu_host: str, prompts_file: Path, chat_file: Path,
    no_leftover_jobs: None
) -> None:
    from tests.fixtures.dashboard import cancel_in_store, submit_job

    fresh = a_grpo_run(api, store, prompts_file, "grpo-no-steps-yet", [])
    page.goto(f"/#/jobs/{fresh['id']}")
    page.locator("main[data-history-loaded=true]").wait_for()
    page.get_by_test_id("job-rollouts").get_by_text("Each step's first rollouts appear here as the job trains.").wait_for()
    sft = submit_job(api, chat_file, max_steps=2, name="sft-no-rollouts", gpus=4)
    cancel_in_store(store, sft["id"])
    page.goto(f"/#/jobs/{sft['id']}")
    page.get_by_test_id("job-title").filter(has_text="sft-no-rollouts").wait_for()
    page.locator("main[data-history-loaded=true]").wait_for()
    assert not page.get_by_test_id("job-rollouts").is_visible()


def test_compare_overlays_the_reward_curves_and_shows_eval_scores_across_runs(
    page: Any, api: httpx.Client, store: Any, gpu_host: str, prompts_file: Path, no_leftover_jobs: None
) -> None:
    created = api.post("/v1/evals", json={
        "name": "numbers", "testing_criteria": [{"type": "string_check", "name": "exact", "operation": "eq",
                                                 "input": "{{sample.output_text}}", "reference": "{{item.a}}"}],
        "data_source_config": {"type": "custom", "item_schema": {
            "type": "object", "properties": {"q": {"type": "string"}, "a": {"type": "string"}}, "required": ["q", "a"]}}})
    assert created.status_code == 200, created.text
    eval_id = created.json()["id"]
    evals = [{"eval_id": eval_id, "data_source": {
        "type": "completions", "source": {"type": "file_content", "content": EVAL_ITEMS},
        "input_messages": {"type": "template", "template": [{"role": "user", "content": "Say {{item.q}}"}]}}}]
    rising = a_grpo_run(api, store, prompts_file, "grpo-cmp-rising", [0.1, 0.3, 0.6, 0.9], status="succeeded",
                        evals=evals)
    flat = a_grpo_run(api, store, prompts_file, "grpo-cmp-flat", [0.2, 0.2, 0.25, 0.2], status="succeeded",
                      evals=evals)
    rates = {rising["id"]: (0.5, 1.0), flat["id"]: (0.5, 0.5)}

    def compared(route: Any) -> None:
        job_id = route.request.url.split("/v1/jobs/")[1].split("/")[0]
        base, tuned = rates[job_id]
        route.fulfill(json={"object": "list", "data": [{"eval_id": eval_id, "base": None, "tuned": None, "items": [],
                                                        "criteria": [{"name": "exact", "base": base, "tuned": tuned,
                                                                      "difference": tuned - base}]}]})

    page.route("**/v1/jobs/*/evals", compared)
    page.goto(f"/#/compare?ids={rising['id']},{flat['id']}")
    page.wait_for_function("() => document.querySelector('[data-testid=chart-compare-reward]')?.dataset.points === '4'")
    legend = page.get_by_test_id("chart-compare-reward-legend").inner_text()
    assert "grpo-cmp-rising" in legend and "grpo-cmp-flat" in legend
    assert "0.9" in legend and "0.2" in legend, legend  # each run's last reward mean
    assert not page.get_by_test_id("chart-compare-eval").is_visible()  # no validation loss in either
    [row] = page.get_by_test_id("compare-eval-row").all()
    assert row.get_attribute("data-key") == f"{eval_id} · exact"
    scores = {c.get_attribute("data-job"): c.inner_text() for c in row.get_by_test_id("compare-eval-score").all()}
    assert scores == {rising["id"]: "50.0% → 100.0% (+50.0 pts)", flat["id"]: "50.0% → 50.0% (+0.0 pts)"}
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-compare-grpo.png"), full_page=True)


def test_compare_of_sft_runs_draws_no_reward_chart_and_no_eval_table(
    page: Any, api: httpx.Client, store: Any, gpu_host: str, chat_file: Path, no_leftover_jobs: None
) -> None:
    from tests.fixtures.dashboard import cancel_in_store, submit_job

    jobs = [submit_job(api, chat_file, max_steps=2, name=f"sft-cmp-{k}", gpus=4) for k in range(2)]
    for job in jobs:
        cancel_in_store(store, job["id"])
    page.goto(f"/#/compare?ids={jobs[0]['id']},{jobs[1]['id']}")
    page.get_by_test_id("chart-compare-loss").wait_for()
    page.get_by_test_id("compare-differing").wait_for()
    assert not page.get_by_test_id("chart-compare-reward").is_visible()
    assert not page.get_by_test_id("compare-evals").is_visible()
