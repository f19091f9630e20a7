"""Every error becomes one JSON shape, mapped in one place.

    {"error": {"code": str, "message": str, "param": str | null, "line"?: int, "details"?: [...]}}

Domain errors (``core.errors``) map to status codes by type; request validation errors
(422) are rewritten to name the field (``hyperparameters.learning_rate``) and say what to do,
instead of pydantic's ``loc`` tuples; HTTP errors (unknown route, wrong method) keep their
status and get the same envelope.

Safety nets stand behind the checks at the edges: a store that cannot be reached
(``OperationalError``) or a connection pool exhausted under load (``TimeoutError``) is a 503,
and a value the store refuses (``DataError``: a NUL character in text, an integer out of the
column's range) is a 422 rather than a 500. None should be reached by a request the schemas
already checked; each is logged when it is.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import (
    Conflict,
    Forbidden,
    FtqError,
    InvalidDataset,
    InvalidInput,
    NotFound,
    TooLarge,
    Unauthenticated,
    Unavailable,
)

log = logging.getLogger(__name__)

STATUS_BY_ERROR: tuple[tuple[type[FtqError], int], ...] = (
    (Unauthenticated, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (TooLarge, 413),
    (InvalidInput, 422),
    (Conflict, 409),
    (Unavailable, 503),
)
_LOC_ROOTS = ("body", "query", "path", "header", "cookie")
_STRICT_TYPES: dict[str, dict[type, str]] = {  # the job spec's strict types (core.jobs.spec): what to send
    "int_type": {str: "send a JSON integer, without quotes", float: "send a whole number, without a decimal point"},
    "float_type": {str: "send a JSON number, without quotes"},
    "bool_type": {str: "send true or false, without quotes", int: "send true or false", float: "send true or false"},
}


def error_body(code: str, message: str, *, param: str | None = None, **extra: Any) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message, "param": param}
    error.update({k: v for k, v in extra.items() if v is not None})
    return {"error": error}


def status_for(exc: FtqError) -> int:
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def add_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(FtqError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(OperationalError, _store_error)  # type: ignore[arg-type]
    app.add_exception_handler(DataError, _data_error)  # type: ignore[arg-type]
    app.add_exception_handler(PoolTimeout, _overloaded)  # type: ignore[arg-type]


async def _domain_error(request: Request, exc: FtqError) -> JSONResponse:
    if status_for(exc) >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc.message)
    return domain_response(exc)


def domain_response(exc: FtqError) -> JSONResponse:
    status = status_for(exc)
    line = exc.line if isinstance(exc, InvalidDataset) else None
    # RFC 9110: a 401 names the scheme that would work.
    headers = {"WWW-Authenticate": 'Bearer realm="ftq"'} if status == 401 else None
    return JSONResponse(
        error_body(exc.code, exc.message, param=exc.param, line=line), status_code=status, headers=headers
    )


def store_unreachable(exc: OperationalError) -> JSONResponse:
    log.warning("the job store is unreachable: %s", exc.orig)
    return JSONResponse(
        error_body("unavailable", "the job store is unreachable; retry in a moment (GET /readyz says when it is back)"),
        status_code=503,
        headers={"Retry-After": "5"},
    )


def too_many_failures(retry_after_s: int, *, key_id: str | None = None) -> JSONResponse:
    """429 for a locked bucket of ``api.auth_throttle``: the key id ``key_id``, or (None) the
    address's requests with no key the store knows."""
    message = (
        f"too many failed requests with the API key {key_id}; it answers 429 for {retry_after_s} s more, "
        "whatever the rest of the key. If it was revoked or its user disabled, ask an admin for a new key"
        if key_id else
        f"too many requests with an unknown or malformed API key from this address; wait {retry_after_s} s, "
        "or send a valid key ('Authorization: Bearer <key>'), which is never refused for others' failures"
    )
    return JSONResponse(
        error_body("too_many_failed_keys", message, param="Authorization"),
        status_code=429,
        headers={"Retry-After": str(retry_after_s)},
    )


async def _store_error(request: Request, exc: OperationalError) -> JSONResponse:
    return store_unreachable(exc)


async def _overloaded(request: Request, exc: PoolTimeout) -> JSONResponse:
    log.warning("%s %s: no store connection came free in time: %s", request.method, request.url.path, exc)
    return JSONResponse(
        error_body("unavailable", "the API is overloaded (no store connection came free in time); retry shortly"),
        status_code=503,
        headers={"Retry-After": "2"},
    )


async def _data_error(request: Request, exc: DataError) -> JSONResponse:
    log.warning("%s %s: the store refused a value: %s", request.method, request.url.path, exc.orig)
    return JSONResponse(
        error_body(
            "invalid_input",
            "a value in this request cannot be stored (a NUL character in text, or an integer "
            "out of range); remove or shorten it",
        ),
        status_code=422,
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(
        error_body(code, str(exc.detail)), status_code=exc.status_code, headers=getattr(exc, "headers", None)
    )


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    root = _body_model(request)
    details = [_describe(err, root) for err in exc.errors()]
    first = details[0] if details else {"param": None, "message": "invalid request"}
    message = first["message"]
    if len(details) > 1:
        message += f" (and {len(details) - 1} more problem{'s' if len(details) > 2 else ''}: see details)"
    return JSONResponse(
        error_body("invalid_input", message, param=first["param"], details=details if len(details) > 1 else None),
        status_code=422,
    )


def _describe(err: dict[str, Any], root: type[BaseModel] | None) -> dict[str, Any]:
    loc = [str(p) for p in err.get("loc", ())]
    where = loc[0] if loc else ""
    path = loc[1:] if where in _LOC_ROOTS else loc
    param = ".".join(path) or where or None
    label = param or "body"
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid"))
    if kind == "extra_forbidden":
        known = _known_fields(root, path[:-1]) if where == "body" else None
        hint = f"; known fields here: {', '.join(known)}" if known else ""
        text = f"{label}: unknown field, remove it or fix its spelling{hint}"
    elif kind == "missing":
        text = f"{label}: required; add it"
    elif kind == "json_invalid":  # loc holds a character offset, not a field: name the body
        at = f" at character {path[0]}" if path and path[0].isdigit() else ""
        text = f"body: not valid JSON{at} ({err.get('ctx', {}).get('error', msg)}); send a JSON object"
        param = None
    elif kind in ("value_error", "assertion_error"):
        text = f"{label}: {msg.removeprefix('Value error, ').removeprefix('Assertion failed, ')}"
    elif hint := _STRICT_TYPES.get(kind, {}).get(type(err.get("input"))):
        text = f"{label}: {msg}{_got(err)}; {hint}"
    else:
        text = f"{label}: {msg}{_got(err)}"
    return {"param": param, "message": text}


def _got(err: dict[str, Any]) -> str:
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 80:
        return f" (got {value!r})"
    return ""


def _body_model(request: Request) -> type[BaseModel] | None:
    """The body's model: the route's, or the one a route that parses its body itself chose
    (``request.state.body_model``: ``POST /v1/jobs``, a training or a generation spec)."""
    chosen = getattr(request.state, "body_model", None)
    if isinstance(chosen, type) and issubclass(chosen, BaseModel):
        return chosen
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    info = getattr(field, "field_info", None)
    annotation = getattr(info, "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _known_fields(model: type[BaseModel] | None, path: list[str]) -> list[str] | None:
    """The field names of the (nested) model at ``path``, for 'unknown field' hints."""
    for name in path:
        if model is None or name not in model.model_fields:
            return None
        annotation = model.model_fields[name].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(model.model_fields) if model is not None else None
