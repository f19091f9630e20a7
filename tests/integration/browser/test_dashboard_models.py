"""A model pulled on the box (``ftq models pull``, from a hub on localhost) is listed by ``ftq models``
and offered by the dashboard's new-job form, with no restart: the single-box flow end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.stack import Stack
from tests.integration.fake_hub import FakeHub

pytestmark = [pytest.mark.integration, pytest.mark.browser]

REPO = "org/pulled-llama"


@pytest.fixture
def hub(dashboard_stack: Stack) -> Iterator[FakeHub]:
    model = dashboard_stack.model_root / dashboard_stack.model
    with FakeHub() as hub:
        hub.add(REPO, {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()})
        yield hub


def ftq(stack: Stack, hub: FakeHub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``ftq ARGS`` as a user's shell on the box runs it: the stack's client config (its key and
    URL), no FTQ_MODEL_ROOT (the pull asks the API where models go), the hub at ``hub.url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTQ_", "HF_"))}
    env.update(FTQ_CONFIG=stack.env["FTQ_CONFIG"], FTQ_API_URL=stack.url, HF_ENDPOINT=hub.url,
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    return subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_pulled_model_is_listed_and_offered_by_the_new_job_form(
    page: Any, dashboard_stack: Stack, hub: FakeHub, tmp_path: Path
) -> None:
    pulled = ftq(dashboard_stack, hub, tmp_path, "models", "pull", REPO)
    assert pulled.returncode == 0, pulled.stderr
    assert (dashboard_stack.model_root / REPO / "config.json").is_file()

    listing = ftq(dashboard_stack, hub, tmp_path, "models")
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith(REPO))
    assert "KB" in row and "LlamaForCausalLM" in row

    page.goto("/#/new")
    option = page.locator(f"[data-testid=model-select] option[value='{REPO}']")
    option.wait_for(state="attached")
    page.get_by_label("Base model").select_option(REPO)
    info = page.get_by_test_id("model-info").inner_text()
    assert "LlamaForCausalLM" in info and "on disk" in info
