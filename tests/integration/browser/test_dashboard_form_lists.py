"""The new-job form offers the values the API lists (``trainer.catalog`` through the job spec's
``/openapi.json``), the API's default selected (test_dashboard.py submits the form)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from core.jobs.spec import Hyperparameters
from trainer.catalog import SCHEDULERS

pytestmark = [pytest.mark.integration, pytest.mark.browser]


def test_the_lr_schedules_come_from_the_api_schema_with_its_default_selected(page: Any, api: httpx.Client) -> None:
    page.goto("/#/new")
    schedule = page.get_by_label("LR schedule")
    schedule.locator(f"option[value={SCHEDULERS[-1]}]").wait_for(state="attached")
    assert schedule.evaluate("s => [...s.options].map(o => o.value)") == list(SCHEDULERS)
    assert schedule.input_value() == Hyperparameters.model_fields["lr_scheduler"].default
    schema = api.get("/openapi.json").json()["components"]["schemas"]["Hyperparameters"]
    assert schema["properties"]["lr_scheduler"]["enum"] == list(SCHEDULERS)
