"""The dashboard in real headless Chromium against a real stack.

``dashboard_stack``: ``ftq up`` on the embedded default (SQLite store, SQLAlchemy broker, one
CPU worker) in a tmp data dir, with a model root holding a tiny random-weight Llama. The
process handling (``Stack``) is the end-to-end suite's.

``browser``: Debian's ``/usr/bin/chromium`` (or ``FTQ_TEST_CHROMIUM``) driven by the Python
``playwright`` package through its executable path; nothing is downloaded. Without a
Chromium the tests are skipped locally and fail under CI (``CI`` set).

``cuttable_proxy``: a TCP forwarder in front of the API whose open connections a test can cut,
to drop the dashboard's event stream the way a flaky network would.

Screenshots: with ``FTQ_DASHBOARD_SCREENSHOTS=DIR`` the tests save the pages they drive
there (``docs/`` holds the committed ones).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.browser.helpers import MODEL, CuttableProxy
from tests.integration.e2e.stack import STACK_ENV, Stack, free_port, read_bootstrap_key

CHROMIUM = os.environ.get("FTQ_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WORDS = ("the cat sat on a mat and the dog ran in the park while birds sang songs of spring "
         "under a bright blue sky near the old stone bridge").split()


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the browser tests)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"no Chromium at {CHROMIUM}; install Debian's chromium or set FTQ_TEST_CHROMIUM")
    return CHROMIUM


@pytest.fixture(scope="module")
def dashboard_stack(tmp_path_factory: pytest.TempPathFactory, chromium_path: str) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("dashboard")
    models = base / "models"
    subprocess.run(
        [sys.executable, "-m", "trainer", "make-tiny-model", str(models / MODEL), "--arch", "llama"],
        check=True, capture_output=True, timeout=300,
    )
    port = free_port()
    stack = Stack("dashboard", f"http://127.0.0.1:{port}", base / "data", models)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
    env.update(STACK_ENV, FTQ_DATA_DIR=str(stack.data_dir), FTQ_MODEL_ROOT=str(models), FTQ_PORT=str(port),
               FTQ_CONFIG=str(base / "client-config.toml"))
    stack.env = env
    stack.start("up", [sys.executable, "-m", "cli", "up", "--no-demo-model"], env)
    try:
        stack.api_key = read_bootstrap_key(stack)  # the admin key the first `ftq up` printed
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def api(dashboard_stack: Stack) -> Iterator[httpx.Client]:
    with dashboard_stack.client() as client:
        yield client


@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def anonymous_page(browser: Any, dashboard_stack: Stack) -> Iterator[Any]:
    """A fresh page at the stack's URL, not logged in; page errors fail the test."""
    yield from _page(browser, dashboard_stack, None)


@pytest.fixture
def page(browser: Any, dashboard_stack: Stack) -> Iterator[Any]:
    """A fresh page logged in as the admin (``POST /v1/session`` from the browser context, so
    the HttpOnly cookie is in its jar); page errors (uncaught exceptions) fail the test."""
    yield from _page(browser, dashboard_stack, dashboard_stack.api_key)


def _page(browser: Any, dashboard_stack: Stack, api_key: str | None) -> Iterator[Any]:
    context = browser.new_context(base_url=dashboard_stack.url, viewport={"width": 1400, "height": 1000})
    if api_key is not None:
        login = context.request.post("/v1/session", data={"api_key": api_key})
        assert login.ok, login.text()
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"the dashboard raised in the browser: {errors}\n{dashboard_stack.log_tail()}"


@pytest.fixture
def no_leftover_jobs(api: httpx.Client) -> Iterator[None]:
    """Cancel whatever a test left queued or running, so the single worker is free for the next."""
    yield
    for status in ("queued", "running"):
        for job in api.get("/v1/jobs", params={"status": status, "limit": 200}).json()["data"]:
            api.post(f"/v1/jobs/{job['id']}/cancel")


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 short chat records over a small vocabulary."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("browser-data") / "support-chats.jsonl"
    with path.open("w") as f:
        for _ in range(48):
            question = " ".join(rng.choices(WORDS, k=6))
            answer = " ".join(rng.choices(WORDS[:8], k=12))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture
def cuttable_proxy(dashboard_stack: Stack) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(int(dashboard_stack.url.rsplit(":", 1)[1]))
    try:
        yield proxy
    finally:
        proxy.close()
