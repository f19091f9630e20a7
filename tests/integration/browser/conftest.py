"""The dashboard in real headless Chromium against a real stack.

``dashboard_stack``: ``ftq up`` on the embedded default (SQLite store, SQLAlchemy broker, one
CPU worker) in a tmp data dir, with a model root holding a copy of ``tiny_llama``
(tests/fixtures/training_inputs.py). The process handling (``Stack``) is tests/fixtures/stack.py.
One for the whole folder, with the Chromium: package scope (``__init__.py`` makes the folder a
package), and ``make test`` hands the folder to one pytest-xdist worker whole (``FOLDER_UNITS`` in
tests/conftest.py). Starting ``ftq up`` costs ~13 s of CPU; it was once per module. So a module
finds the jobs, users, projects and pulled models of the modules before it: each test checks
what it made, never that a list holds only that.

``browser``: Debian's ``/usr/bin/chromium`` (or ``FTQ_TEST_CHROMIUM``) driven by the Python
``playwright`` package through its executable path; nothing is downloaded. Without a
Chromium the tests are skipped locally and fail under CI (``CI`` set).

``cuttable_proxy``: a TCP forwarder in front of the API whose open connections a test can cut,
to drop the dashboard's event stream the way a flaky network would.

Screenshots: with ``FTQ_DASHBOARD_SCREENSHOTS=DIR`` the tests save the pages they drive
there (``docs/`` holds the committed ones).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.dashboard import GIB, GPU_HOST, MODEL, CuttableProxy, live_host
from tests.fixtures.stack import STACK_ENV, Stack, free_port, read_bootstrap_key
from tests.fixtures.training_inputs import write_chat_dataset

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


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the browser tests)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"no Chromium at {CHROMIUM}; install Debian's chromium or set FTQ_TEST_CHROMIUM")
    return CHROMIUM


@pytest.fixture(scope="package")
def dashboard_stack(tmp_path_factory: pytest.TempPathFactory, chromium_path: str, tiny_llama: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("dashboard")
    models = base / "models"
    shutil.copytree(tiny_llama, models / MODEL)  # a root of its own: a test pulls a model into it
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


@pytest.fixture(scope="package")
def api(dashboard_stack: Stack) -> Iterator[httpx.Client]:
    with dashboard_stack.client() as client:
        yield client


@pytest.fixture(scope="package")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page_as(browser: Any, dashboard_stack: Stack) -> Iterator[Callable[..., Any]]:
    """``page_as(api_key)``: a fresh page at the stack's URL logged in with ``api_key``
    (``POST /v1/session`` from the browser context, so the HttpOnly cookie is in its jar), or not
    logged in with None; ``width``/``height`` set its viewport. Each page has a browser context of
    its own, closed after the test; page errors (uncaught exceptions) on any of them fail the test."""
    contexts: list[Any] = []
    errors: list[str] = []

    def open_page(api_key: str | None, *, width: int = 1400, height: int = 1000) -> Any:
        context = browser.new_context(base_url=dashboard_stack.url, viewport={"width": width, "height": height})
        contexts.append(context)
        if api_key is not None:
            login = context.request.post("/v1/session", data={"api_key": api_key})
            assert login.ok, login.text()
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        return page

    try:
        yield open_page
    finally:
        for context in contexts:
            context.close()
    assert not errors, f"the dashboard raised in the browser: {errors}\n{dashboard_stack.log_tail()}"


@pytest.fixture
def anonymous_page(page_as: Callable[..., Any]) -> Any:
    """A fresh page at the stack's URL, not logged in."""
    return page_as(None)


@pytest.fixture
def page(page_as: Callable[..., Any], dashboard_stack: Stack) -> Any:
    """A fresh page logged in as the admin."""
    return page_as(dashboard_stack.api_key)


@pytest.fixture
def no_leftover_jobs(api: httpx.Client) -> Iterator[None]:
    """Cancel whatever a test left queued or running, so the single worker is free for the next."""
    yield
    for status in ("queued", "running"):
        for job in api.get("/v1/jobs", params={"status": status, "limit": 200}).json()["data"]:
            api.post(f"/v1/jobs/{job['id']}/cancel")


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 short chat records over a small vocabulary, named as a user's upload would be."""
    return write_chat_dataset(tmp_path_factory.mktemp("browser-data") / "support-chats.jsonl", 48)


@pytest.fixture
def cuttable_proxy(dashboard_stack: Stack) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(int(dashboard_stack.url.rsplit(":", 1)[1]))
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def store(dashboard_stack: Stack) -> Iterator[Any]:
    """A sessionmaker on the stack's SQLite store, to write rows as a worker would."""
    from core.db import make_engine, make_sessionmaker

    engine = make_engine(f"sqlite:///{dashboard_stack.data_dir / 'ftq.db'}")
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


@pytest.fixture
def gpu_host(store: Any) -> Iterator[str]:
    """``GPU_HOST``, a live worker host with 4 H100s written into the store (its heartbeat set
    ahead, so it stays live for the test), removed afterwards."""
    hardware = {"hardware": {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "gpu_memory": 80 * GIB}}
    with live_host(store, GPU_HOST, 4, hostname=GPU_HOST, device="cuda:0,1,2,3", hardware=hardware) as host:
        yield host
