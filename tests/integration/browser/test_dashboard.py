"""The dashboard driven in headless Chromium against a real API, worker and trainer.

Each test uses the page as a person would (labels, buttons) and checks the result both on
the page and through the API.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import MODEL, SMALL, CuttableProxy, cancel_and_wait, screenshot_dir, submit_job
from trainer.config import SWITCHES, switch_docs

pytestmark = [pytest.mark.integration, pytest.mark.browser]

def wait_until(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def points(page: Any, testid: str = "chart-loss") -> int:
    return int(page.get_attribute(f"[data-testid={testid}]", "data-points"))


def job_status(api: httpx.Client, job_id: str) -> str:
    return api.get(f"/v1/jobs/{job_id}").json()["status"]


def test_a_bad_dataset_upload_shows_the_line_and_why(page: Any, tmp_path: Path) -> None:
    bad = tmp_path / "broken.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + '{"messages": [oops\n')
    page.goto("/#/new")
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(bad))

    result = page.locator("[data-testid=upload-result-train][data-state=error]")
    result.wait_for()
    assert result.get_attribute("data-line") == "3"
    message = page.get_by_test_id("upload-error-train").inner_text()
    assert "broken.jsonl" in message and "line 3" in message and "not valid JSON" in message
    assert page.get_by_test_id("upload-bad-line-train").inner_text() == '{"messages": [oops'

    # A good file replaces the error with what the API learned about it.
    good_file = tmp_path / "good.jsonl"
    good_file.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": 2}) + "\n")
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(good_file))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    accepted = page.get_by_test_id("upload-result-train").inner_text()
    assert "2 records" in accepted and "format chat" in accepted
    assert "Messages per record (mean): 2" in accepted


def test_api_validation_errors_are_shown_next_to_their_fields(page: Any, chat_file: Path) -> None:
    page.goto("/#/new")
    page.locator("[data-testid=model-select] option[value='tiny-llama']").wait_for(state="attached")
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(chat_file))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    page.get_by_label("Learning rate").fill("5")
    page.get_by_role("button", name="Submit job").click()

    page.get_by_test_id("submit-error").wait_for()
    field = page.get_by_label("Learning rate")
    assert field.get_attribute("aria-invalid") == "true"
    beside = field.locator("xpath=..").locator(".field-error").inner_text()
    assert "hyperparameters.learning_rate" in beside and "1" in beside
    assert page.url.endswith("#/new")  # nothing was submitted

    # A cross-field problem is shown on its group.
    page.get_by_label("Learning rate").fill("0.001")
    page.get_by_label("Train for").fill("5")
    page.get_by_label("Warm-up steps").fill("9")
    page.get_by_role("button", name="Submit job").click()
    page.get_by_test_id("submit-error").filter(has_text="warmup_steps (9) must be < max_steps (5)").wait_for()

    # A model typed by hand that the box refuses: the service's message, on the model field.
    page.get_by_label("Warm-up steps").fill("0")
    page.get_by_label("Base model").select_option(label="Another model (hub id or path)…")
    page.get_by_label("Model name").fill("../outside")
    page.get_by_role("button", name="Submit job").click()
    page.get_by_test_id("submit-error").filter(has_text="'..' is not allowed").wait_for()
    assert page.get_by_label("Base model").get_attribute("aria-invalid") == "true"
    assert page.url.endswith("#/new")


def test_submit_through_the_form_and_watch_the_charts_grow(
    page: Any, api: httpx.Client, chat_file: Path, no_leftover_jobs: None
) -> None:
    max_steps = 40
    page.goto("/#/new")
    page.get_by_label("Base model").select_option(MODEL)
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(chat_file))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    stats = page.locator("[data-testid=dataset-token-stats][data-state=ok]")
    stats.wait_for()
    assert re.match(r"\d+ records · [\d,]+ tokens \(\d+/[\d.]+/\d+ per record\) · [\d,]+ loss tokens", stats.inner_text())
    page.get_by_label("Job name (optional)").fill("form-run")
    page.get_by_label("Train for").fill(str(max_steps))
    page.get_by_label("Tokens per batch").fill(str(SMALL["batch_tokens"]))
    page.get_by_label("Max sequence length").fill(str(SMALL["max_seq_len"]))
    page.get_by_label("Warm-up steps").fill("2")
    page.get_by_label("Checkpoint every (steps)").fill("20")
    page.get_by_label("LoRA rank r").fill("4")
    page.get_by_test_id("opt-moe_grouped_routing-off").check()
    # The switches come from the API's schema, which the trainer's config defines: all of them, in order.
    shown = page.get_by_test_id("switch").evaluate_all("els => els.map(e => e.dataset.param)")
    assert shown == [f"optimizations.{name}" for name in SWITCHES]
    assert switch_docs()["offload_activations"][0] in page.get_by_test_id("switches").inner_text()
    page.get_by_role("button", name="Submit job").click()

    page.wait_for_url("**/#/jobs/job-*")
    job_id = page.url.rsplit("/", 1)[1]
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["name"] == "form-run"
    assert job["spec"]["hyperparameters"]["max_steps"] == max_steps
    assert job["spec"]["checkpoint_every"] == 20
    assert job["spec"]["optimizations"]["moe_grouped_routing"] == "off"

    # The loss chart grows live, step by step, over the event stream.
    seen: list[int] = []

    def grown_to(n: int) -> bool:
        seen.append(points(page))
        return seen[-1] >= n

    wait_until(lambda: grown_to(3), 180, "the first steps on the loss chart")
    # A reload mid-run loads the history from /metrics, then resumes the stream: no gap.
    page.reload()
    page.locator("main[data-history-loaded=true]").wait_for()
    wait_until(lambda: grown_to(max_steps), 180, f"{max_steps} points on the loss chart")
    page.locator("main[data-status=succeeded]").wait_for(timeout=60_000)

    distinct = sorted(set(seen))
    assert len(distinct) >= 3, f"the chart did not grow in steps: {seen}"
    assert seen[-1] == max_steps
    for testid in ("chart-loss", "chart-tokens", "chart-step-time", "chart-memory"):
        assert points(page, testid) == max_steps, testid
    metrics = api.get(f"/v1/jobs/{job_id}/metrics").json()["data"]
    assert [m["step"] for m in metrics] == list(range(1, max_steps + 1))
    assert f"step {max_steps}" in page.get_by_test_id("chart-loss").get_attribute("aria-label")

    assert page.get_by_test_id("progress").inner_text().startswith(f"{max_steps} / {max_steps}")
    plan_rows = page.get_by_test_id("plan-row")
    names = [plan_rows.nth(i).get_attribute("data-name") for i in range(plan_rows.count())]
    assert {"packed_metadata_cache", "double_buffered_reload", "moe_grouped_routing"} <= set(names)
    assert names[:4] == ["attention", "loss", "lora_kernel", "fused_ops"]  # the kernel choices lead the table
    moe = page.locator("[data-testid=plan-row][data-name=moe_grouped_routing]")
    assert moe.get_attribute("data-enabled") == "false"
    assert "off" in moe.inner_text()
    steps = [r.get_attribute("data-step") for r in page.get_by_test_id("checkpoint-row").all()]
    assert steps == ["20", "40"]
    adapter = page.get_by_test_id("download-adapter")
    assert adapter.get_attribute("href") == f"/v1/jobs/{job_id}/adapter"
    assert api.get(adapter.get_attribute("href")).status_code == 200
    # The export button: the worker merges the adapter, the table follows it to its download link.
    page.get_by_test_id("export-merged").click()
    page.locator("[data-testid=export-row][data-format=merged][data-status=succeeded]").wait_for(timeout=180_000)
    merged = api.get(page.get_by_test_id("download-export").get_attribute("href"))
    assert merged.status_code == 200 and merged.headers["content-type"] == "application/zip"
    assert "→ succeeded" in page.locator("[data-testid=event-log] [data-type=state]").last.inner_text()
    assert page.get_by_test_id("cancel-job").count() == 0

    if shots := screenshot_dir():
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(shots / "dashboard-job.png"), full_page=True)


def test_a_dropped_stream_resumes_with_no_event_lost_or_repeated(
    page: Any, api: httpx.Client, chat_file: Path, cuttable_proxy: CuttableProxy, no_leftover_jobs: None
) -> None:
    max_steps = 80
    job = submit_job(api, chat_file, max_steps=max_steps, name="flaky-network")
    page.goto(f"{cuttable_proxy.url}/#/jobs/{job['id']}")
    live = page.get_by_test_id("live-state")
    wait_until(lambda: points(page) >= 3 and live.get_attribute("data-opens") == "1", 180, "the first steps")

    before = points(page)
    assert before < max_steps and page.get_attribute("main", "data-status") == "running"
    cuttable_proxy.cut()  # the network drops: EventSource reconnects with Last-Event-ID
    wait_until(lambda: live.get_attribute("data-opens") == "2", 60, "the event stream to reconnect")
    page.locator("main[data-status=succeeded]").wait_for(timeout=180_000)

    assert points(page) == max_steps
    assert live.get_attribute("data-duplicates") == "0"  # the server resumed after the last id
    seqs = [int(s) for s in page.locator("[data-testid=event-log] li").evaluate_all("els => els.map(e => e.dataset.seq)")]
    assert len(seqs) == len(set(seqs)) and seqs == sorted(seqs)
    kinds = page.locator("[data-testid=event-log] li").evaluate_all("els => els.map(e => e.dataset.type)")
    assert kinds.count("plan") == 1 and kinds[-1] == "state"


def test_cancel_a_running_job_from_its_page_and_see_the_queue(
    page: Any, api: httpx.Client, chat_file: Path, no_leftover_jobs: None
) -> None:
    running = submit_job(api, chat_file, max_steps=100_000, name="long-run")
    waiting = [submit_job(api, chat_file, max_steps=10, name=f"waiting-{i}") for i in (1, 2)]

    page.goto(f"/#/jobs/{running['id']}")
    wait_until(lambda: points(page) >= 1, 180, "the long job's first step")

    # The jobs list shows the running job's throughput as it goes.
    page.get_by_role("link", name="Jobs", exact=True).click()
    live_row = page.locator(f"[data-testid=job-row][data-job-id='{running['id']}'][data-status=running]")
    wait_until(lambda: live_row.get_by_test_id("job-tokens-per-s").inner_text() not in ("", "–"), 30,
               "tokens/s of the running job in the list")
    assert page.locator("[data-testid=job-row][data-status=queued]").count() == 2
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-jobs.png"), full_page=True)

    # The GPUs view: the worker runs the long job; the two others wait, oldest first.
    page.get_by_role("link", name="GPUs").click()
    card = page.get_by_test_id("worker-card").first
    card.get_by_test_id("worker-job").get_by_role("link", name="long-run").wait_for()
    rows = page.get_by_test_id("queue-row")
    rows.nth(1).wait_for()
    assert [(r.get_attribute("data-job-id"), r.get_attribute("data-position")) for r in rows.all()] == [
        (waiting[0]["id"], "1"),
        (waiting[1]["id"], "2"),
    ]
    # Both wait for the long job (the worker has one slot): their start is estimated from its pace.
    wait_until(lambda: rows.nth(0).get_by_test_id("queue-eta").inner_text().startswith("in "), 30,
               "the first waiting job's estimated start")
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-gpus.png"), full_page=True)
    for job in waiting:
        assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    page.get_by_test_id("queue-empty").wait_for()

    # Cancel from the job page: the button asks first, then the job stops cleanly.
    card.get_by_test_id("worker-job").get_by_role("link", name="long-run").click()
    page.wait_for_url(f"**/#/jobs/{running['id']}")
    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Yes, cancel it").click()
    page.locator("main[data-status=cancelled]").wait_for(timeout=120_000)
    assert job_status(api, running["id"]) == "cancelled"
    assert page.get_by_test_id("cancel-job").count() == 0
    assert "cancelled" in page.get_by_test_id("job-status").inner_text()


def test_jobs_list_shows_every_job_and_filters_by_status(page: Any, api: httpx.Client, chat_file: Path) -> None:
    jobs = api.get("/v1/jobs", params={"limit": 200}).json()["data"]
    if not any(j["status"] == "succeeded" for j in jobs):
        pytest.skip("needs the jobs of the tests above (run the module)")
    page.goto("/#/jobs")
    rows = page.get_by_test_id("job-row")
    rows.nth(len(jobs) - 1).wait_for()
    assert [r.get_attribute("data-job-id") for r in rows.all()] == [j["id"] for j in jobs]
    for job in (j for j in jobs if j["status"] == "succeeded"):
        row = page.locator(f"[data-testid=job-row][data-job-id='{job['id']}']")
        total = job["progress"]["total_steps"]
        assert row.get_by_test_id("progress").inner_text() == f"{total} / {total} (100%)"
        row.get_by_test_id("job-tokens-per-s").filter(has_text=re.compile(r"^\d")).wait_for()  # e.g. "4.98k"

    page.get_by_label("Status").select_option("cancelled")
    page.wait_for_url("**/#/jobs?status=cancelled")
    cancelled = {j["id"] for j in jobs if j["status"] == "cancelled"}
    page.locator("[data-testid=job-row][data-status=cancelled]").nth(len(cancelled) - 1).wait_for()
    shown = {r.get_attribute("data-job-id") for r in page.get_by_test_id("job-row").all()}
    assert shown == cancelled

    page.get_by_test_id("job-row").first.get_by_role("link").click()
    page.wait_for_url("**/#/jobs/job-*")
    assert page.url.rsplit("/", 1)[1] in shown
    page.locator("main[data-status=cancelled]").wait_for()


def test_gpu_memory_is_drawn_against_the_cards_capacity(
    page: Any, api: httpx.Client, dashboard_stack: Any, chat_file: Path
) -> None:
    """A GPU job's memory rows (written to the store as the worker would) against the plan's
    card capacity; the CPU box cannot produce them itself."""
    from sqlalchemy import update

    from core.db import make_engine, make_sessionmaker
    from core.jobs.models import Job, StepMetric

    job = submit_job(api, chat_file, max_steps=10, name="gpu-shaped")
    cancel_and_wait(api, job["id"])
    gib = 1 << 30
    plan = {"device": "cuda", "dtype": "bfloat16", "model_attention": "sdpa",
            "decisions": [{"name": "attention", "requested": "auto", "enabled": True, "backend": "torch_varlen",
                           "reason": "packed batches"}],
            "hardware": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "gpu_memory": 80 * gib,
                         "capability": [9, 0]}}
    engine = make_engine(f"sqlite:///{dashboard_stack.data_dir / 'ftq.db'}")
    try:
        with make_sessionmaker(engine)() as session:
            session.execute(update(Job).where(Job.job_id == job["id"]).values(plan=plan, progress_step=5))
            session.query(StepMetric).filter_by(job_id=job["id"]).delete()  # steps it ran before the cancel
            session.add_all(
                StepMetric(job_id=job["id"], step=step, loss=3.0 - 0.1 * step, tokens_per_s=9000.0 + step,
                           step_ms=400.0, data_ms=5.0, forward_ms=130.0, backward_ms=240.0, optimizer_ms=20.0,
                           gpu_mem_allocated=(14 + step) * gib, gpu_mem_reserved=(18 + step) * gib,
                           gpu_mem_peak=(20 + step) * gib, gpu_alloc_retries=4 if step == 3 else 0, host_rss=3 * gib)
                for step in range(1, 6)
            )
            session.commit()
    finally:
        engine.dispose()
    page.goto(f"/#/jobs/{job['id']}")
    page.locator("main[data-history-loaded=true]").wait_for()
    assert points(page, "chart-memory") == 5
    legend = page.get_by_test_id("chart-memory-legend")
    legend.filter(has_text="GPU capacity 80.0 GiB").wait_for()
    text = legend.inner_text()
    assert "allocated 19.0 GiB" in text and "reserved 23.0 GiB" in text and "peak 25.0 GiB" in text
    assert "host RSS 3.00 GiB" in text
    assert "NVIDIA H100 80GB HBM3" in page.get_by_test_id("plan").inner_text()
    page.locator("[data-testid=chart-step-time][data-marks='1']").wait_for()  # step 3's allocator retries
    assert "allocator retries 4 in 1 step" in page.get_by_test_id("chart-step-time-legend").inner_text()


def test_login_logout_owners_and_who_may_cancel(
    anonymous_page: Any, api: httpx.Client, dashboard_stack: Any, chat_file: Path, no_leftover_jobs: None
) -> None:
    page = anonymous_page
    page.goto("/#/jobs")
    page.get_by_test_id("login-form").wait_for()
    assert "next=" in page.url
    page.get_by_label("API key").fill("ftq_00000000_not-a-real-key-at-all")
    page.get_by_role("button", name="Log in").click()
    assert "not valid" in page.get_by_test_id("login-error").inner_text()
    page.get_by_label("API key").fill(dashboard_stack.api_key)
    page.get_by_role("button", name="Log in").click()
    page.get_by_test_id("jobs-table").wait_for()
    assert page.get_by_test_id("whoami-name").inner_text() == "admin (admin)"
    # The key lives only in the HttpOnly cookie: no page script can read it back.
    stored = page.evaluate("() => JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage)])")
    assert dashboard_stack.api_key not in stored
    assert "ftq_session" not in page.evaluate("() => document.cookie")

    dave = dashboard_stack.create_user("dave")
    admins = submit_job(api, chat_file, max_steps=100_000, name="admins-job")
    with dashboard_stack.client(headers={"Authorization": f"Bearer {dave}"}) as as_dave:
        daves = submit_job(as_dave, chat_file, max_steps=10, name="daves-job")

    page.get_by_test_id("logout").click()
    page.get_by_test_id("login-form").wait_for()
    assert page.evaluate("() => fetch('/v1/jobs').then((r) => r.status)") == 401
    page.get_by_label("API key").fill(dave)
    page.get_by_role("button", name="Log in").click()
    page.get_by_test_id("jobs-table").wait_for()
    admin_row = page.locator(f"[data-testid=job-row][data-job-id='{admins['id']}']")
    assert admin_row.get_by_test_id("job-owner").inner_text() == "admin"

    # Someone else's job: the owner is shown and there is no cancel button (the API says 403 anyway).
    page.goto(f"/#/jobs/{admins['id']}")
    page.get_by_test_id("job-owner").filter(has_text="admin").wait_for()
    page.locator("main[data-status]").wait_for()
    assert page.get_by_test_id("cancel-job").count() == 0
    # One's own queued job can be cancelled.
    page.goto(f"/#/jobs/{daves['id']}")
    page.get_by_test_id("job-owner").filter(has_text="dave").wait_for()
    page.get_by_test_id("cancel-job").wait_for()

    page.goto("/#/jobs")
    page.get_by_label("Owner").select_option("me")
    page.wait_for_url("**/#/jobs?owner=me")
    page.locator(f"[data-testid=job-row][data-job-id='{daves['id']}']").wait_for()
    wait_until(lambda: {r.get_attribute("data-job-id") for r in page.get_by_test_id("job-row").all()} == {daves["id"]},
               10, "only dave's jobs under 'Mine'")


def test_the_form_previews_the_data_and_the_job_page_shows_eval_and_samples(
    page: Any, api: httpx.Client, chat_file: Path, no_leftover_jobs: None
) -> None:
    """Issue 14 on the dashboard: the new-job form's preflight preview (counts, the rendered record
    with its trained text marked, a refusal shown on the field it names), then a job's eval loss,
    summary and greedy sample generations on its page."""
    before = len(api.get("/v1/jobs", params={"limit": 100}).json()["data"])
    page.goto("/#/new")
    page.get_by_label("Base model").select_option(MODEL)
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(chat_file))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    page.get_by_label("Tokens per batch").fill(str(SMALL["batch_tokens"]))
    page.get_by_label("Max sequence length").fill(str(SMALL["max_seq_len"]))
    page.get_by_role("button", name="Preview data").click()
    counts = page.get_by_test_id("preflight-counts")
    counts.wait_for()
    assert "48" in counts.inner_text() and "Trainable tokens" in counts.inner_text()
    trained = page.locator("[data-testid=preflight-example] .trainable")
    assert trained.count() >= 1 and trained.first.inner_text().strip()
    assert page.locator("[data-testid=preflight-example] .prompt").count() >= 1
    assert len(api.get("/v1/jobs", params={"limit": 100}).json()["data"]) == before, "a preview creates no job"

    page.get_by_label("Max sequence length").fill("8")
    page.get_by_role("button", name="Preview data").click()
    page.get_by_test_id("submit-error").filter(has_text="cut before its first trainable token").wait_for()
    assert page.get_by_label("Max sequence length").get_attribute("aria-invalid") == "true"

    with chat_file.open("rb") as fh:
        validation = api.post("/v1/files", data={"purpose": "validation"}, files={"file": (chat_file.name, fh)})
    job = submit_job(api, chat_file, 4, "results", validation_file=validation.json()["id"], checkpoint_every=2,
                     sample_prompts=["the cat sat"], sample_max_new_tokens=4)
    page.goto(f"/#/jobs/{job['id']}")
    page.locator("main[data-status=succeeded]").wait_for(timeout=180_000)
    page.locator("[data-testid=sample-step][data-step='4']").wait_for()
    assert page.get_by_test_id("sample-step").count() == 2  # at the checkpoints, 2 and 4 (final)
    assert "the cat sat" in page.get_by_test_id("samples").inner_text()
    page.get_by_test_id("summary-eval").filter(has_text="/").wait_for()
    evals = api.get(f"/v1/jobs/{job['id']}/metrics").json()["eval"]
    assert [e["step"] for e in evals] == [2, 4]
    shown = repr(float(f"{evals[-1]['loss']:.4g}"))  # the page's fmtNumber: 4 significant digits
    assert page.get_by_test_id("summary-eval").inner_text().startswith(shown)
    assert page.locator("[data-testid=event-log] [data-type=sample]").count() == 2


def _pairs_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"input": {"messages": [{"role": "user", "content": f"What is {i} plus one?"}]},
                                        "preferred_output": [{"role": "assistant", "content": f"{i + 1}."}],
                                        "non_preferred_output": [{"role": "assistant", "content": "No idea."}]}) + "\n"
                            for i in range(8)))
    return path


def test_a_dpo_job_is_submitted_through_the_form(page: Any, api: httpx.Client, tmp_path: Path,
                                                 no_leftover_jobs: None) -> None:
    """Objective and beta on the new-job form; the preference file's token counts (both sequences)."""
    page.goto("/#/new")
    page.get_by_label("Base model").select_option(MODEL)
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(_pairs_file(tmp_path / "pairs.jsonl")))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    page.locator("[data-testid=dataset-token-stats][data-state=ok]").wait_for()
    assert not page.get_by_label("DPO beta").is_visible()
    page.get_by_label("Objective").select_option("dpo")
    # the objectives, their titles and their settings come from the job spec's schema (the registry)
    from trainer.objectives.registry import declarations

    titles = [d.title for d in declarations()]
    assert titles[:2] == ["SFT", "DPO"]  # and every objective registered since (GRPO, ...)
    assert page.get_by_label("Objective").locator("option").all_inner_texts() == titles
    assert page.get_by_label("DPO label smoothing").get_attribute("placeholder") == "0"
    assert page.get_by_label("DPO beta").get_attribute("placeholder") == "0.1"  # the API's default
    page.get_by_label("DPO beta").fill("0.2")
    page.get_by_label("Job name (optional)").fill("form-dpo")
    page.get_by_label("Train for").fill("2")
    page.get_by_label("Tokens per batch").fill(str(SMALL["batch_tokens"]))
    page.get_by_label("Max sequence length").fill(str(SMALL["max_seq_len"]))
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url("**/#/jobs/job-*")
    spec = api.get(f"/v1/jobs/{page.url.rsplit('/', 1)[1]}").json()["spec"]
    assert (spec["objective"], spec["dpo"]["beta"], spec["name"]) == ("dpo", 0.2, "form-dpo")


def test_a_dpo_jobs_page_charts_its_rewards_and_log_probs(
    page: Any, api: httpx.Client, dashboard_stack: Any, chat_file: Path, tmp_path: Path
) -> None:
    """DPO step rows (written to the store as the worker would) draw the reward and log-prob
    charts, which an SFT job's page does not show."""
    from core.db import make_engine, make_sessionmaker
    from core.jobs.models import StepMetric

    job = submit_job(api, _pairs_file(tmp_path / "pairs.jsonl"), max_steps=10, name="dpo-charts", objective="dpo")
    cancel_and_wait(api, job["id"])
    engine = make_engine(f"sqlite:///{dashboard_stack.data_dir / 'ftq.db'}")
    try:
        with make_sessionmaker(engine).begin() as session:
            session.query(StepMetric).filter_by(job_id=job["id"]).delete()  # steps it ran before the cancel
            session.add_all(StepMetric(job_id=job["id"], step=step, loss=0.7 - 0.05 * step, metrics={
                "reward_margin": 0.25 * step, "reward_accuracy": 0.5 + 0.1 * step, "chosen_logp": -50.0 + step,
                "rejected_logp": -60.0 - step}) for step in range(1, 6))
    finally:
        engine.dispose()
    page.goto(f"/#/jobs/{job['id']}")
    page.locator("main[data-history-loaded=true]").wait_for()
    assert page.get_by_test_id("chart-dpo-reward").is_visible() and page.get_by_test_id("chart-dpo-logps").is_visible()
    assert points(page, "chart-dpo-reward") == points(page, "chart-dpo-logps") == 5
    assert "lora · DPO (beta 0.1)" in page.get_by_test_id("job-meta").inner_text()
    rewards = page.get_by_test_id("chart-dpo-reward-legend").inner_text()
    assert "margin 1.25" in rewards and "accuracy 1" in rewards, rewards
    logps = page.get_by_test_id("chart-dpo-logps-legend").inner_text()
    assert "chosen -45" in logps and "rejected -65" in logps, logps
    sft = submit_job(api, chat_file, max_steps=10, name="sft-no-dpo-charts")
    cancel_and_wait(api, sft["id"])
    page.goto(f"/#/jobs/{sft['id']}")
    page.get_by_test_id("job-title").filter(has_text="sft-no-dpo-charts").wait_for()
    assert page.get_by_test_id("chart-loss").is_visible()
    assert not page.get_by_test_id("chart-dpo-reward").is_visible() and not page.get_by_test_id("chart-dpo-logps").is_visible()
