"""The job page's tracking banner, in headless Chromium: a tracker the worker could not run (its
package missing, as ``worker.tracking.resolve`` writes it) is shown above the job's details, not
only as a line of the event log; a job without such a warning shows no banner.

The warning is written into the stack's store by the worker's own ``warning_writer`` (the stack's
worker has every tracker installed, so it would not write one itself)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import cancel_and_wait, screenshot_dir, submit_job

pytestmark = [pytest.mark.integration, pytest.mark.browser]


def test_a_tracker_the_worker_could_not_run_is_a_banner_on_the_job_page(
    page: Any, api: httpx.Client, dashboard_stack: Any, chat_file: Path
) -> None:
    from core.db import make_engine, make_sessionmaker
    from core.jobs.trackers import missing_message
    from worker.tracking.resolve import warning_writer

    job = submit_job(api, chat_file, max_steps=10, name="tracked")
    message = missing_message("wandb", "tracking.wandb", "box-a/gpu0")
    engine = make_engine(f"sqlite:///{dashboard_stack.data_dir / 'ftq.db'}")
    try:  # as the worker writes it when the job starts: before the job's final state
        runtime = SimpleNamespace(sessionmaker=make_sessionmaker(engine), publish=lambda job_id, seq: None)
        warning_writer(runtime, job["id"])(message)
    finally:
        engine.dispose()
    cancel_and_wait(api, job["id"])

    page.goto(f"/#/jobs/{job['id']}")
    banner = page.get_by_test_id("job-tracking-warnings")
    banner.wait_for()
    assert page.get_by_test_id("job-tracking-warning").all_inner_texts() == [message]
    assert "Experiment tracking" in banner.inner_text()
    assert "make up SERVICE_EXTRAS=tracking" in banner.inner_text()
    assert page.locator("[data-testid=event-log] .level-warning").count() >= 1  # the log line too
    if (shots := screenshot_dir()) is not None:
        page.screenshot(path=str(shots / "dashboard-job-tracking-warning.png"), full_page=False)

    quiet = submit_job(api, chat_file, max_steps=10, name="untracked")
    cancel_and_wait(api, quiet["id"])
    page.goto(f"/#/jobs/{quiet['id']}")
    page.locator("[data-testid=event-log] [data-type=state]").filter(has_text="cancelled").wait_for()
    assert not banner.is_visible()  # the whole history has been replayed: no tracking warning in it
