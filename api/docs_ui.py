"""The API docs pages, Swagger UI at ``/docs`` and ReDoc at ``/redoc``, that work without internet.

FastAPI's default pages load Swagger UI's and ReDoc's JavaScript, CSS and favicon from a CDN (and
ReDoc's fonts from Google Fonts), so on an offline box they stay blank. Here the files come from
the ``fastapi-offline`` package (its ``static/`` folder, found with ``importlib.resources``, never
copied into ftq), served by the app under ``/static/docs/`` (open without a key, as the dashboard's
``/static/`` is: ``api/auth.py``), and the pages are FastAPI's own ``get_swagger_ui_html`` and
``get_redoc_html`` pointed at them. Swagger UI's ``validatorUrl`` is off: by default it sends the
schema's URL to validator.swagger.io for a badge. ReDoc 2 has no switch for the Redocly logo its
menu loads from cdn.redoc.ly, so the pages carry a Content-Security-Policy (``DOCS_CSP``) that lets
them load only from this origin: the browser refuses that image (ReDoc then hides it) and
anything else a later Swagger UI or ReDoc would fetch from elsewhere.

``mount_docs_assets`` serves the files once, on the outermost app; ``add_docs_pages`` serves the
pages of any FastAPI app built with ``docs_url=None, redoc_url=None``: the main one and the
OpenAI-compatible sub-app (``/openai/v1/docs``). Both find the files under the outermost app's
root path (``uvicorn --root-path /ftq`` behind a proxy), and their schema under their own.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS_PATH = "/static/docs"
ASSET_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
# Inline: Swagger UI's start-up script in the page, the styles both inject; data: for their icons;
# blob: for ReDoc's search worker.
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:"
)


def assets_dir() -> Path:
    """The folder of Swagger UI's and ReDoc's files, as the installed ``fastapi-offline`` ships it."""
    return Path(str(resources.files("fastapi_offline") / "static"))


def mount_docs_assets(app: FastAPI) -> None:
    """Serve ``ASSET_FILES`` at ``ASSETS_PATH``: mount before any route that serves ``/static``."""
    app.mount(ASSETS_PATH, StaticFiles(directory=assets_dir()), name="docs-assets")


def add_docs_pages(app: FastAPI) -> None:
    """Serve ``app``'s Swagger UI at ``/docs`` (with its OAuth2 redirect page) and ReDoc at ``/redoc``.

    Plain routes, as FastAPI's own docs routes are: the app's dependencies do not run for them.
    """
    openapi_url, redirect_url = app.openapi_url, app.swagger_ui_oauth2_redirect_url
    assert openapi_url and redirect_url, f"{app.title}: docs need openapi_url and the redirect url"

    async def swagger_ui(request: Request) -> HTMLResponse:
        root, assets = _roots(request)
        return _same_origin_only(get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + redirect_url,
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        ))

    async def oauth2_redirect(_request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root, assets = _roots(request)
        return _same_origin_only(get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{assets}/redoc.standalone.js",
            redoc_favicon_url=f"{assets}/favicon.png",
            with_google_fonts=False,
        ))

    app.add_route("/docs", swagger_ui, include_in_schema=False)
    app.add_route(redirect_url, oauth2_redirect, include_in_schema=False)
    app.add_route("/redoc", redoc, include_in_schema=False)


def _roots(request: Request) -> tuple[str, str]:
    """``(this app's root path, the asset folder's URL path)``: in a mounted sub-app ``root_path``
    ends with the mount's prefix, while ``app_root_path`` stays the outermost app's."""
    root = request.scope.get("root_path", "").rstrip("/")
    outer = request.scope.get("app_root_path", root).rstrip("/")
    return root, outer + ASSETS_PATH


def _same_origin_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = DOCS_CSP
    return page
