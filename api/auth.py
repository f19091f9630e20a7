"""Who is calling: every ``/v1`` request needs an API key, as a Bearer token or the session cookie.

``auth_gate`` is an app-wide dependency (``create_app``), so a route added later is protected
without remembering to be. It lets through what must stay open, the probes (``/healthz``,
``/readyz``), ``/docs``, ``/openapi.json``, the dashboard's static shell (``/``, ``/static``) and
``/v1/session`` (the login itself), and verifies the key of everything else under ``/v1``.
Routes that need the caller take ``CallerDep``; the caller is verified once per request.

Browsers cannot put a header on an ``EventSource`` or a download link, so the dashboard logs in
with ``POST /v1/session`` (body ``{"api_key": ...}``), which sets the ``ftq_session`` cookie
holding the key: ``HttpOnly`` (page scripts cannot read it), ``SameSite=Strict`` (no other site's
page makes the browser send it), ``Secure`` when served over HTTPS. The key is verified on every
request as a Bearer key is, so revoking it ends the session at once.

CSRF: ``SameSite=Strict`` already keeps the cookie off cross-site requests. As a second
layer a request authenticated by the cookie that changes something (not GET/HEAD/OPTIONS)
must also carry the ``X-Requested-With`` header: a cross-site form cannot set headers, and a
cross-site script cannot send one without a CORS preflight, which this API never grants.
Bearer requests need no such header: a browser never adds a Bearer key on its own.
"""

from __future__ import annotations

from typing import Annotated

from anyio import to_thread
from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPBearer

from api.state import AppState
from core.errors import Forbidden, Unauthenticated
from core.users.service import Caller, verify_key

SESSION_COOKIE = "ftq_session"
CSRF_HEADER = "X-Requested-With"
SESSION_MAX_AGE_S = 7 * 24 * 3600
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset({"/v1/session"})

# Declared only so /docs shows an "Authorize" button; the gate reads the request itself.
_bearer_scheme = HTTPBearer(auto_error=False, description="An API key: ftq_<prefix>_<secret>")
_cookie_scheme = APIKeyCookie(name=SESSION_COOKIE, auto_error=False, description="Set by POST /v1/session")


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") and path.rstrip("/") not in OPEN_PATHS


def route_path(request: Request) -> str:
    """The path as the router matched it: the route's template, else the URL path without the
    ASGI ``root_path`` (which a proxy deployment, ``uvicorn --root-path /ftq``, puts in front of
    it, so ``request.url.path`` would read ``/ftq/v1/...`` and never look like ``/v1/``)."""
    template = getattr(request.scope.get("route"), "path", None)
    if isinstance(template, str):
        return template
    path, root = request.scope["path"], request.scope.get("root_path") or ""
    return path[len(root):] if root and path.startswith(root) else path


def credentials(request: Request) -> tuple[str | None, bool]:
    """``(raw key, came from the cookie)``: the Authorization header wins over the cookie."""
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                "Authorization: use the form 'Bearer <api key>'", param="Authorization"
            )
        return token.strip(), False
    cookie = request.cookies.get(SESSION_COOKIE)
    return (cookie, True) if cookie else (None, False)


async def authenticate(request: Request) -> Caller:
    """Verify the request's key (once per request) and return its caller."""
    known = getattr(request.state, "caller", None)
    if isinstance(known, Caller):
        return known
    raw, via_cookie = credentials(request)
    if raw is None:
        raise Unauthenticated(
            "this endpoint needs an API key: send 'Authorization: Bearer <key>' (the CLI reads "
            "FTQ_API_KEY or the file `ftq login` writes), or log in on the dashboard; an admin "
            "makes keys with `ftq users create NAME`",
            param="Authorization",
        )
    if via_cookie and request.method not in SAFE_METHODS and not request.headers.get(CSRF_HEADER):
        raise Forbidden(
            f"a request authenticated by the session cookie that changes something must carry the "
            f"{CSRF_HEADER} header (any value); API clients should send 'Authorization: Bearer <key>' instead",
            param=CSRF_HEADER,
        )
    state: AppState = request.state.ftq

    def verify() -> Caller:
        with state.sessions() as session:
            caller = verify_key(session, raw)
            session.commit()
            return caller

    caller = await to_thread.run_sync(verify)
    request.state.caller = caller
    return caller


async def auth_gate(
    request: Request,
    _bearer: Annotated[object, Depends(_bearer_scheme)] = None,
    _cookie: Annotated[object, Depends(_cookie_scheme)] = None,
) -> None:
    """App-wide: refuse a ``/v1`` request without a valid key (401) before its route runs."""
    if needs_key(route_path(request)):
        await authenticate(request)


async def require_admin(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    if not caller.is_admin:
        raise Forbidden(f"only an admin may do this; you are {caller.name!r}, not an admin")
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]
AdminDep = Annotated[Caller, Depends(require_admin)]
