"""The dashboard is served by the app: the page, its modules and stylesheet, nothing remote."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.web.routes import STATIC_DIR
from core.migrate import upgrade
from core.settings import Settings


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The app refuses an unmigrated store at start-up, so migrate one SQLite file per module."""
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'ftq.db'}"
    upgrade(url)
    return url


@pytest.fixture
def client(tmp_path: Path, store_url: str) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path / "data", model_root=tmp_path / "models", database_url=store_url)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_root_serves_the_dashboard_page(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.headers["cache-control"] == "no-cache"
    assert '<script type="module" src="/static/app.js">' in response.text


def test_every_module_import_and_asset_is_served_locally(client: TestClient) -> None:
    """Follow index.html's assets and every ES-module import: all answer 200 from the app."""
    page = client.get("/").text
    pending = re.findall(r'(?:src|href)="(/static/[^"]+)"', page)
    seen: set[str] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["cache-control"] == "no-cache"
        if path.endswith(".js"):
            assert "javascript" in response.headers["content-type"]
            pending += ["/static/" + name for name in re.findall(r'from "\./([^"]+)"', response.text)]
    assert {"/static/app.js", "/static/charts.js", "/static/api.js", "/static/style.css"} <= seen
    assert seen == {f"/static/{p.name}" for p in STATIC_DIR.iterdir() if p.suffix in (".js", ".css")}


def test_no_asset_references_a_remote_url() -> None:
    for path in STATIC_DIR.iterdir():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"""(?:src|href|import|from|url\()\s*=?\s*["'(]?(?:https?:)?//""", text), path.name


def test_static_paths_cannot_escape_the_package(client: TestClient) -> None:
    assert client.get("/static/../routes.py").status_code == 401  # the client makes it /routes.py: not open
    assert client.get("/static/%2e%2e/routes.py").status_code == 404
    assert client.get("/static/missing.js").status_code == 404


def test_the_dashboard_is_not_in_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths
    assert "/v1/models" in paths
