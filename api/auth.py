"""Who is calling: every request needs an API key, as a Bearer token or the session cookie,
except a short list of open paths.

Deny by default: ``AuthGate`` is ASGI middleware around the whole app, so it sees every request
(routes, mounts, nested routers, a 404) by its URL path, whatever the route's template looks
like; a route added later is protected without remembering to be. Open (``OPEN_PATHS``) are
only the probes (``/healthz``, ``/readyz``), the API docs (``/docs``, ``/redoc``,
``/openapi.json``; their Swagger UI and ReDoc files under ``/static/docs/``, ``api.docs_ui``),
the dashboard's static shell (``/``, ``/static/...``) and ``/v1/session`` (the login itself).
Paths under ``/v1/worker/`` take only worker keys (``ftqw_...``, ``api.workers.auth``; a user's
key there is 403), and a worker key anywhere else is 403. The verified caller is kept on the
request state, so routes that need it (``CallerDep``) get it without a second check. Failed keys
are logged and, repeated, slowed down: per key id for keys the store has, per address for the
rest, and never a valid key for other keys' failures (``api.auth_throttle``).

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

import dataclasses
from typing import Annotated

from anyio import to_thread
from fastapi import Depends, Request
from fastapi.security import APIKeyCookie, HTTPBearer
from sqlalchemy.exc import OperationalError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth_throttle import FailedKeyThrottle, by_address, by_key
from api.errors import domain_response, store_unreachable, too_many_failures
from api.openai.errors import openai_shaped
from api.state import AppState
from api.workers.auth import authenticate_worker, is_worker_path, refuse_worker_key
from core.errors import Forbidden, FtqError, Unauthenticated
from core.users import access
from core.keys import public_key_id, split_key
from core.users.service import USER_KEYS, Caller, verify_key
from core.workers.keys import WORKER_KEYS

SESSION_COOKIE = "ftq_session"
CSRF_HEADER = "X-Requested-With"
SESSION_MAX_AGE_S = 7 * 24 * 3600
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = frozenset(
    {"/", "/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/v1/session"}
)
OPEN_PREFIXES = ("/static/",)

# Declared only so /docs shows an "Authorize" button; the gate reads the request itself.
_bearer_scheme = HTTPBearer(auto_error=False, description="An API key: ftq_<prefix>_<secret>")
_cookie_scheme = APIKeyCookie(name=SESSION_COOKIE, auto_error=False, description="Set by POST /v1/session")


def is_open(path: str) -> bool:
    """Whether ``path`` (as ``app_path`` gives it) is served without a key."""
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def app_path(scope: Scope) -> str:
    """The URL path without the ASGI ``root_path`` (which a proxy deployment,
    ``uvicorn --root-path /ftq``, puts in front of it)."""
    path, root = scope["path"], scope.get("root_path") or ""
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
    refuse_worker_key(raw)
    state: AppState = request.state.ftq

    def verify() -> Caller:
        with state.sessions() as session:
            caller = verify_key(session, raw)
            session.commit()
            return caller

    caller = await to_thread.run_sync(verify)  # a bad key is a 401 even without the CSRF header
    if via_cookie and request.method not in SAFE_METHODS and not request.headers.get(CSRF_HEADER):
        raise Forbidden(
            f"a request authenticated by the session cookie that changes something must carry the "
            f"{CSRF_HEADER} header (any value); API clients should send 'Authorization: Bearer <key>' instead",
            param=CSRF_HEADER,
        )
    request.state.caller = caller
    return caller


OPENAI_PROJECT_HEADER = "OpenAI-Project"


async def authenticate_openai(request: Request) -> Caller:
    """``authenticate`` for ``/openai/v1`` (the OpenAI app overrides it with this): the caller seen
    through the project the ``OpenAI-Project`` header names (a name or id), else their key's or
    their own default project, reading only their own rows there (``Caller.per_owner``), as an
    OpenAI project key does. A project that does not exist or is not theirs is a 404 naming the header."""
    known = getattr(request.state, "openai_caller", None)
    if isinstance(known, Caller):
        return known
    caller = await authenticate(request)
    named = request.headers.get(OPENAI_PROJECT_HEADER, "").strip()
    project_id = caller.project_id
    if named:
        state: AppState = request.state.ftq

        def lookup() -> str:
            with state.sessions() as session:
                return access.project_named(session, caller, named, param=OPENAI_PROJECT_HEADER)

        project_id = await to_thread.run_sync(lookup)
    scoped = dataclasses.replace(caller, project_ids=frozenset({project_id}) if project_id else frozenset(),
                                 project_id=project_id, per_owner=True)
    request.state.openai_caller = scoped
    return scoped


async def declare_schemes(
    _bearer: Annotated[object, Depends(_bearer_scheme)] = None,
    _cookie: Annotated[object, Depends(_cookie_scheme)] = None,
) -> None:
    """App-wide, for the OpenAPI document only (``/docs`` shows "Authorize"); ``AuthGate`` checks."""


class AuthGate:
    """ASGI middleware: refuse every request to a path that is not open unless its key is good
    (401, or 429 after repeated failures: per key id, or per address for keys the store does not
    know; ``api.auth_throttle``), before any route or mount runs."""

    def __init__(self, app: ASGIApp, throttle: FailedKeyThrottle) -> None:
        self.app = app
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or is_open(app_path(scope)):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        address = request.client.host if request.client else "unknown"
        key_id = _key_id(request)
        # Before the check, only what cannot be a valid key waits: a locked id, or no well-formed
        # key at all from a locked address. Any other key is checked first (a valid one passes).
        wait = self.throttle.retry_after(by_key(key_id) if key_id else by_address(address))
        if wait is not None:
            refusal: Response | None = too_many_failures(wait, key_id=key_id)
        else:
            refusal = await self._refusal(request, address, key_id)
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await openai_shaped(refusal, app_path(scope))(scope, receive, send)

    async def _refusal(self, request: Request, address: str, key_id: str | None) -> Response | None:
        try:
            if is_worker_path(app_path(request.scope)):
                await authenticate_worker(request)  # worker keys only there (api.workers.auth)
            else:
                await authenticate(request)
        except Unauthenticated as exc:
            # A stored key's failures count against its id; the rest against the address,
            # which, once locked, refuses them even though they were checked.
            bucket = by_key(exc.key_id) if exc.key_id else by_address(address)
            wait = None if exc.key_id else self.throttle.retry_after(bucket)
            if wait is not None:
                return too_many_failures(wait)
            self.throttle.record_failure(bucket, address=address, path=app_path(request.scope), key_id=key_id,
                                         reason=exc.message)
            return domain_response(exc)
        except FtqError as exc:
            return domain_response(exc)
        except OperationalError as exc:
            return store_unreachable(exc)
        return None


def _key_id(request: Request) -> str | None:
    """The public id (``ftq_<prefix>``, ``ftqw_<prefix>``) of the well-formed key a request
    carries, as ``core.keys.public_key_id`` writes it; None for no key or a malformed one."""
    try:
        raw, _ = credentials(request)
    except Unauthenticated:
        return None
    if raw is None:
        return None
    for kind in (USER_KEYS, WORKER_KEYS):
        parts = split_key(raw.strip(), expected=kind.scheme)
        if parts is not None:
            return public_key_id(kind.scheme, parts[0])
    return None


async def require_admin(caller: Annotated[Caller, Depends(authenticate)]) -> Caller:
    if not caller.is_admin:
        raise Forbidden(f"only an admin may do this; you are {caller.name!r}, not an admin")
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]
AdminDep = Annotated[Caller, Depends(require_admin)]
