"""The dashboard: ``/`` serves the single page, ``/static/...`` its ES modules and stylesheet.

Every asset ships inside this package (``api/web/static``) and is served by the app, so the
dashboard works on a box with no internet: no CDN, no build step, no bundler. The page is a
plain ES-module app with hash routing (``#/jobs``, ``#/jobs/<id>``, ``#/new``, ``#/gpus``)
that talks only to the public ``/v1`` API, the same one the CLI uses.

Assets are sent with ``Cache-Control: no-cache``: the browser keeps them but revalidates
with the ETag each time (a 304 costs a round trip, not the bytes), so an upgraded server
never runs next to a stale ``app.js``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).resolve().parent / "static"
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


class RevalidatedStaticFiles(StaticFiles):
    """StaticFiles whose responses carry ``Cache-Control: no-cache`` (see the module docstring)."""

    def file_response(self, full_path, stat_result, scope: Scope, status_code: int = 200):  # type: ignore[no-untyped-def]
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(NO_CACHE)
        return response


@router.get("/", response_class=FileResponse)
def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=NO_CACHE)


router.mount("/static", RevalidatedStaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
