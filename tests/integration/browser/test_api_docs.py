"""The API docs in headless Chromium with every request that would leave the box refused.

``/docs`` (Swagger UI) lists the API's operations and ``/redoc`` renders them, reached from the
URL ``ftq up`` prints and from the dashboard's footer link, with only the assets installed with ftq
(``api/docs_ui.py``); the OpenAI-compatible sub-app's docs likewise. Each test also asserts that the
page did not even try another host.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.fixtures.dashboard import screenshot_dir

pytestmark = [pytest.mark.integration, pytest.mark.browser]

UP_LINE = re.compile(r"ftq is up: (\S+)\s+\(API docs: (\S+);")
CSP_BLOCKED_URL = re.compile(r"'(\w+://[^']+)'")  # "Loading the image 'https://…' violates …"


def refuse_other_hosts(page: Any, server_url: str) -> list[str]:
    """Abort every request from ``page`` whose host is not the server's. Returns the list, filled as
    the page runs, of those requests, and of Content-Security-Policy refusals of anything but an
    off-box URL (the policy breaking a local asset or the inline script). An off-box load the
    policy refuses (ReDoc's Redocly logo) never leaves the browser and is not listed."""
    server = urlsplit(server_url).netloc
    found: list[str] = []

    def only_the_box(route: Any) -> None:
        url = urlsplit(route.request.url)
        if url.scheme in ("data", "blob") or url.netloc == server:
            route.continue_()
        else:
            found.append(route.request.url)
            route.abort()

    def csp_report(message: Any) -> None:
        if "Content Security Policy" not in message.text:
            return
        blocked = CSP_BLOCKED_URL.search(message.text)
        if blocked is None or urlsplit(blocked.group(1)).netloc in ("", server):
            found.append(f"CSP broke a local load: {message.text}")

    page.route("**/*", only_the_box)
    page.on("console", csp_report)
    return found


def operation(page: Any, method: str, path: str) -> Any:
    """The collapsed row Swagger UI draws for one operation."""
    return page.locator(f'.opblock-{method} .opblock-summary-path[data-path="{path}"]')


def save(page: Any, name: str) -> None:
    if (folder := screenshot_dir()) is not None:
        page.screenshot(path=str(folder / name), full_page=False)


def test_the_url_ftq_up_prints_shows_swagger_ui_listing_the_operations_offline(
    anonymous_page: Any, dashboard_stack: Any
) -> None:
    page = anonymous_page
    printed = UP_LINE.search(dashboard_stack.logs["up"].read_text(errors="replace"))
    assert printed is not None, dashboard_stack.log_tail()
    assert printed.group(2) == f"{printed.group(1)}/docs" == f"{dashboard_stack.url}/docs"
    off_box = refuse_other_hosts(page, dashboard_stack.url)
    page.goto(printed.group(2))
    for method, path in [("get", "/v1/jobs"), ("post", "/v1/jobs"), ("post", "/v1/files"), ("get", "/healthz")]:
        operation(page, method, path).first.wait_for(state="visible")
    assert page.locator(".info .title").inner_text().startswith("ftq")
    assert page.get_by_role("button", name=re.compile("Authorize")).is_visible()
    save(page, "api-docs-swagger.png")
    assert off_box == []


def test_the_dashboards_footer_link_opens_the_docs(anonymous_page: Any, dashboard_stack: Any) -> None:
    page = anonymous_page
    off_box = refuse_other_hosts(page, dashboard_stack.url)
    page.goto("/")
    page.get_by_role("link", name="API docs").click()
    page.wait_for_url(f"{dashboard_stack.url}/docs")
    operation(page, "get", "/v1/jobs").first.wait_for(state="visible")
    assert off_box == []


def test_redoc_renders_the_operations_offline(anonymous_page: Any, dashboard_stack: Any) -> None:
    page = anonymous_page
    off_box = refuse_other_hosts(page, dashboard_stack.url)
    page.goto("/redoc")
    page.get_by_role("heading", name=re.compile(r"^ftq \(0\.1\.0\)")).wait_for(state="visible")
    page.get_by_role("heading", name="List jobs, newest first").wait_for(state="visible")
    save(page, "api-docs-redoc.png")
    assert off_box == []


def test_the_openai_sub_apps_docs_render_offline(page: Any, dashboard_stack: Any) -> None:
    """Logged in (its pages need a key, as everything under /openai/v1 does), from the parent's assets."""
    off_box = refuse_other_hosts(page, dashboard_stack.url)
    page.goto("/openai/v1/docs")
    operation(page, "post", "/fine_tuning/jobs").first.wait_for(state="visible")
    operation(page, "get", "/files").first.wait_for(state="visible")
    page.goto("/openai/v1/redoc")
    page.get_by_role("heading", name="fine_tuning.jobs.create").wait_for(state="visible")
    assert off_box == []
