"""Multi-GPU jobs on the dashboard, in headless Chromium: the new-job form's GPUs field, a job's
GPUs in the jobs list and on its page, its per-rank table, and the GPUs page showing one job
across the GPUs it holds.

The stack's own worker is a CPU box of one slot; a 4-GPU host is written into its store as a
worker registers one (``worker`` + ``gpu_slot`` rows), and a 2-GPU job's claim and step rows as
the worker would write them (``try_claim``, ``StepMetric`` with ``ranks``). The host is removed
afterwards, so the module's other tests see the box as it was."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import GIB, GPU_HOST, cancel_in_store, screenshot_dir, submit_job

pytestmark = [pytest.mark.integration, pytest.mark.browser]

def claim_with_rank_steps(store: Any, job_id: str, steps: int = 3) -> None:
    """The claim of ``job_id`` on GPUs 1 and 2 of the host, and its step rows with two ranks."""
    from sqlalchemy import update

    from core.db import utcnow
    from core.jobs import scheduling
    from core.jobs.models import Job, StepMetric
    from core.jobs.placement import Placement
    from core.jobs.service import append_events, state_event
    from core.jobs.states import JobStatus
    from core.settings import Settings

    with store() as session:
        settings = Settings(max_running_jobs_per_user=0)
        assert scheduling.try_claim(session, Placement(job_id, GPU_HOST, (1, 2)), settings,
                                    values={"worker_id": GPU_HOST, "attempts": 1, "heartbeat_at": utcnow() + dt.timedelta(minutes=10)})
        session.commit()
    with store.begin() as session:
        append_events(session, job_id, [state_event(JobStatus.running, worker_id=GPU_HOST, attempt=1, slots=[1, 2])])
        session.execute(update(Job).where(Job.job_id == job_id).values(progress_step=steps))
        for step in range(1, steps + 1):
            ranks = [
                {"rank": r, "step_ms": 400.0 + 50 * r, "data_ms": 5.0, "forward_ms": 130.0, "backward_ms": 240.0 + 50 * r,
                 "optimizer_ms": 20.0, "tokens": 4000 + r, "gpu_mem_allocated": (14 + r) * GIB,
                 "gpu_mem_reserved": (18 + r) * GIB, "gpu_mem_peak": (20 + r) * GIB, "gpu_alloc_retries": 2 * r,
                 "host_rss": 3 * GIB}
                for r in range(2)
            ]
            session.add(StepMetric(job_id=job_id, step=step, loss=3.0 - 0.1 * step, tokens=8001, tokens_per_s=16000.0,
                                   step_ms=450.0, data_ms=5.0, forward_ms=130.0, backward_ms=290.0, optimizer_ms=20.0,
                                   gpu_mem_allocated=15 * GIB, gpu_mem_reserved=19 * GIB, gpu_mem_peak=21 * GIB,
                                   gpu_alloc_retries=2, host_rss=3 * GIB, ranks=ranks))


def test_the_form_offers_gpus_up_to_the_largest_host_and_shows_a_refusal_at_the_field(
    page: Any, api: httpx.Client, chat_file: Path, gpu_host: str, no_leftover_jobs: None
) -> None:
    page.goto("/#/new")
    page.get_by_test_id("gpus-help").filter(has_text="1 to 4 (gpu-box has the most: 4)").wait_for()
    gpus = page.get_by_label("GPUs")
    assert gpus.get_attribute("max") == "4" and gpus.input_value() == "1"
    page.get_by_label("Base model").select_option("tiny-llama")
    page.get_by_label("Upload a JSONL file").first.set_input_files(str(chat_file))
    page.locator("[data-testid=upload-result-train][data-state=ok]").wait_for()
    page.get_by_label("Train for").fill("20")
    page.get_by_label("Tokens per batch").fill("256")
    page.get_by_label("Max sequence length").fill("128")

    gpus.fill("9")
    page.get_by_role("button", name="Submit job").click()
    page.get_by_test_id("submit-error").filter(has_text="more than any live worker host has").wait_for()
    assert gpus.get_attribute("aria-invalid") == "true"
    beside = gpus.locator("xpath=..").locator(".field-error").inner_text()
    assert "gpu-box (4 GPUs)" in beside and "at most 4" in beside

    gpus.fill("2")
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url("**/#/jobs/job-*")
    job = api.get(f"/v1/jobs/{page.url.rsplit('/', 1)[1]}").json()
    assert job["gpus"] == 2 and job["spec"]["gpus"] == 2
    page.get_by_test_id("job-gpus").filter(has_text="2").wait_for()


def test_a_two_gpu_job_across_its_gpus_on_the_jobs_list_its_page_and_the_gpus_page(
    page: Any, api: httpx.Client, chat_file: Path, store: Any, gpu_host: str, no_leftover_jobs: None
) -> None:
    job = submit_job(api, chat_file, max_steps=10, name="two-gpus", gpus=2)
    claim_with_rank_steps(store, job["id"])
    try:
        _look_at_it(page, job)
    finally:
        cancel_in_store(store, job["id"])


def _look_at_it(page: Any, job: dict[str, Any]) -> None:
    page.goto("/#/jobs")
    cell = page.locator(f"[data-testid=job-row][data-job-id='{job['id']}'] [data-testid=job-gpus]")
    cell.filter(has_text="2 · gpu-box: 1, 2").wait_for()

    page.goto(f"/#/jobs/{job['id']}")
    page.locator("main[data-history-loaded=true]").wait_for()
    assert page.get_by_test_id("job-gpus").inner_text() == "2 · gpu-box: 1, 2"
    rows = page.get_by_test_id("rank-row")
    rows.nth(1).wait_for()
    assert [r.get_attribute("data-rank") for r in rows.all()] == ["0", "1"]
    assert "gpu-box: 1" in rows.nth(0).inner_text() and "gpu-box: 2" in rows.nth(1).inner_text()
    assert rows.nth(1).get_by_test_id("rank-step-ms").inner_text() == "450.0 ms"
    assert rows.nth(1).get_by_test_id("rank-memory").inner_text() == "21.0 GiB"
    assert [r.get_by_test_id("rank-alloc-retries").inner_text() for r in rows.all()] == ["0", "2"]
    assert "slowest" in (rows.nth(1).get_attribute("class") or "")
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-job-ranks.png"), full_page=True)

    page.get_by_role("link", name="GPUs").click()
    card = page.locator(f"[data-testid=worker-card][data-worker-id='{GPU_HOST}']")
    card.get_by_test_id("gpu-slot").nth(3).wait_for()
    slots = card.get_by_test_id("gpu-slot")
    assert [s.get_attribute("data-job-id") for s in slots.all()] == ["", job["id"], job["id"], ""]
    assert slots.nth(1).get_by_test_id("gpu-rank").inner_text() == "rank 0 of 2"
    assert slots.nth(2).get_by_test_id("gpu-rank").inner_text() == "rank 1 of 2"
    assert "free" in slots.nth(0).inner_text()
    block = card.get_by_test_id("worker-job")
    block.get_by_role("link", name="two-gpus").wait_for()
    memory = [m.inner_text() for m in block.get_by_test_id("gpu-memory").all()]
    assert memory == ["rank 0: 18.0 GiB of 80.0 GiB reserved", "rank 1: 19.0 GiB of 80.0 GiB reserved"]
    if shots := screenshot_dir():
        page.screenshot(path=str(shots / "dashboard-gpus-multi.png"), full_page=True)
