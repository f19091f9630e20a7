"""/docs and /redoc (and the OpenAI-compatible sub-app's) load only what the app itself serves."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.docs_ui import ASSET_FILES, ASSETS_PATH, DOCS_CSP, assets_dir
from core.db import make_engine, make_sessionmaker
from core.migrate import upgrade
from core.settings import Settings
from core.users.service import create_user_with_key

# Every URL a page names: attributes, and the strings of its inline script (Swagger's `url: '...'`)
URL_IN_HTML = re.compile(r"""(?:src|href)\s*=\s*["']([^"']*)["']|\burl:\s*["']([^"']*)["']""")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'ftq.db'}"
    upgrade(url)
    return url


@pytest.fixture
def settings(tmp_path: Path, store_url: str) -> Settings:
    return Settings(data_dir=tmp_path / "data", model_root=tmp_path / "models", database_url=store_url)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def api_key(store_url: str) -> str:
    engine = make_engine(store_url)
    try:
        with make_sessionmaker(engine)() as session:
            _user, issued = create_user_with_key(session, "docs-reader")
            session.commit()
            return issued.secret
    finally:
        engine.dispose()


def page_urls(html: str) -> list[str]:
    return [attr or script for attr, script in URL_IN_HTML.findall(html)]


def assert_same_origin(html: str, expected: set[str]) -> None:
    """The page names exactly ``expected`` and nothing that leaves the box."""
    assert "://" not in html and "fonts.googleapis" not in html, html
    assert set(page_urls(html)) == expected, html


class TestDocsPages:
    def test_swagger_ui_names_only_same_origin_urls(self, client: TestClient) -> None:
        response = client.get("/docs")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        assert_same_origin(response.text, {
            f"{ASSETS_PATH}/swagger-ui.css", f"{ASSETS_PATH}/swagger-ui-bundle.js", f"{ASSETS_PATH}/favicon.png",
            "/openapi.json",
        })
        assert '"validatorUrl": null' in response.text  # no schema URL sent to validator.swagger.io
        assert response.headers["content-security-policy"] == DOCS_CSP

    def test_redoc_names_only_same_origin_urls(self, client: TestClient) -> None:
        response = client.get("/redoc")
        assert response.status_code == 200
        assert_same_origin(response.text, {f"{ASSETS_PATH}/redoc.standalone.js", f"{ASSETS_PATH}/favicon.png"})
        assert 'spec-url="/openapi.json"' in response.text
        assert response.headers["content-security-policy"] == DOCS_CSP

    def test_the_pages_policy_loads_from_this_origin_only(self) -> None:
        """ReDoc's menu loads the Redocly logo from cdn.redoc.ly whatever its options: the policy stops it."""
        directives = dict(d.strip().split(" ", 1) for d in DOCS_CSP.split(";"))
        assert directives["default-src"] == "'self'"
        for sources in directives.values():
            assert not re.search(r"https?:|\*", sources), sources

    def test_oauth2_redirect_page_is_served(self, client: TestClient) -> None:
        response = client.get("/docs/oauth2-redirect")
        assert response.status_code == 200 and "://" not in response.text

    def test_docs_are_not_in_the_api_schema(self, client: TestClient) -> None:
        paths = client.get("/openapi.json").json()["paths"]
        assert not {"/docs", "/redoc", "/docs/oauth2-redirect"} & set(paths)

    def test_behind_a_proxy_every_url_carries_the_root_path(self, settings: Settings) -> None:
        with TestClient(create_app(settings), root_path="/ftq") as proxied:
            swagger, redoc = proxied.get("/ftq/docs").text, proxied.get("/ftq/redoc").text
            assert f"/ftq{ASSETS_PATH}/swagger-ui-bundle.js" in page_urls(swagger)
            assert "/ftq/openapi.json" in page_urls(swagger)
            assert f"/ftq{ASSETS_PATH}/redoc.standalone.js" in page_urls(redoc)
            assert proxied.get(f"/ftq{ASSETS_PATH}/swagger-ui.css").status_code == 200


class TestDocsAssets:
    @pytest.mark.parametrize("name", ASSET_FILES)
    def test_each_asset_is_the_installed_file_served_without_a_key(self, client: TestClient, name: str) -> None:
        response = client.get(f"{ASSETS_PATH}/{name}")
        assert response.status_code == 200, name
        assert response.content == (assets_dir() / name).read_bytes()

    def test_scripts_and_stylesheet_have_their_content_types(self, client: TestClient) -> None:
        assert "javascript" in client.get(f"{ASSETS_PATH}/swagger-ui-bundle.js").headers["content-type"]
        assert "javascript" in client.get(f"{ASSETS_PATH}/redoc.standalone.js").headers["content-type"]
        assert client.get(f"{ASSETS_PATH}/swagger-ui.css").headers["content-type"].startswith("text/css")

    def test_the_dashboards_static_files_are_still_served(self, client: TestClient) -> None:
        assert client.get("/static/app.js").status_code == 200
        assert client.get(f"{ASSETS_PATH}/missing.js").status_code == 404


class TestOpenAIDocs:
    """The sub-app under /openai/v1 needs a key for everything, its docs included (api/auth.py)."""

    def test_its_pages_use_the_parents_assets_and_its_own_schema(self, client: TestClient, api_key: str) -> None:
        headers = {"Authorization": f"Bearer {api_key}"}
        swagger = client.get("/openai/v1/docs", headers=headers)
        assert swagger.status_code == 200
        assert_same_origin(swagger.text, {
            f"{ASSETS_PATH}/swagger-ui.css", f"{ASSETS_PATH}/swagger-ui-bundle.js", f"{ASSETS_PATH}/favicon.png",
            "/openai/v1/openapi.json",
        })
        redoc = client.get("/openai/v1/redoc", headers=headers)
        assert_same_origin(redoc.text, {f"{ASSETS_PATH}/redoc.standalone.js", f"{ASSETS_PATH}/favicon.png"})
        assert 'spec-url="/openai/v1/openapi.json"' in redoc.text
        schema = client.get("/openai/v1/openapi.json", headers=headers).json()
        assert "/fine_tuning/jobs" in schema["paths"]
