"""Errors in OpenAI's shape, for everything under ``/openai/v1``.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

The official client reads ``error.message`` into its exception and picks the exception class
by status (400 ``BadRequestError``, 401 ``AuthenticationError``, 403 ``PermissionDeniedError``,
404 ``NotFoundError``, 409 ``ConflictError``, ...), so ftq's domain errors keep their meaning:
a bad request or file is 400 (OpenAI answers 400 where ftq's native API answers 422), and a
dataset error keeps its message, which starts with the line (``line 3: ...``).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from core.errors import (
    Conflict,
    Forbidden,
    FtqError,
    InvalidInput,
    NotFound,
    TooLarge,
    Unauthenticated,
    Unavailable,
)

# (error class, status, OpenAI error type), most specific first.
_MAPPING: tuple[tuple[type[FtqError], int, str], ...] = (
    (Unauthenticated, 401, "authentication_error"),
    (Forbidden, 403, "permission_error"),
    (NotFound, 404, "invalid_request_error"),
    (TooLarge, 413, "invalid_request_error"),
    (InvalidInput, 400, "invalid_request_error"),
    (Conflict, 409, "invalid_request_error"),
    (Unavailable, 503, "server_error"),
)


OPENAI_PATH = "/openai/"
_TYPE_BY_STATUS = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
                   503: "server_error"}


def openai_error(status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def openai_shaped(refusal: Response, path: str) -> Response:
    """The auth gate's refusal (401, 403, 429, 503: ``api.auth.AuthGate``, which answers before
    this sub-app runs) in OpenAI's shape when the request was for ``/openai/``; else unchanged."""
    if not path.startswith(OPENAI_PATH) or not isinstance(refusal, JSONResponse):
        return refusal
    error = json.loads(bytes(refusal.body)).get("error", {})
    shaped = openai_error(refusal.status_code, str(error.get("message", "")), param=error.get("param"),
                          type_=_TYPE_BY_STATUS.get(refusal.status_code, "invalid_request_error"),
                          code=error.get("code"))
    for name in ("www-authenticate", "retry-after"):
        if name in refusal.headers:
            shaped.headers[name] = refusal.headers[name]
    return shaped


def add_openai_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(FtqError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]


async def _domain_error(request: Request, exc: FtqError) -> JSONResponse:
    for cls, status, type_ in _MAPPING:
        if isinstance(exc, cls):
            return openai_error(status, exc.message, type_=type_, param=exc.param, code=exc.code)
    return openai_error(500, exc.message, type_="server_error", param=exc.param, code=exc.code)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path}): ftq's OpenAI-compatible API has no such route"
    else:
        message = str(exc.detail)
    return openai_error(exc.status_code, message)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the first bad field as a dotted ``param`` (``method.dpo.hyperparameters.beta``)."""
    problems: dict[str | None, list[dict[str, Any]]] = {}
    for err in exc.errors():
        problems.setdefault(_param(err), []).append(err)
    if not problems:
        return openai_error(400, "invalid request", code="invalid_request")
    param, errs = next(iter(problems.items()))
    kind = errs[0].get("type", "")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"Missing required parameter: '{param}'."
    elif kind == "json_invalid":
        message = "We could not parse the JSON body of your request; send a JSON object."
    else:
        message = f"Invalid value for '{param}': {_reasons(errs)}{_got(errs[0])}."
    if len(problems) > 1:
        message += f" ({len(problems) - 1} more problem{'s' if len(problems) > 2 else ''} in the request.)"
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    return openai_error(400, message, param=param, code=code)


def _param(err: dict[str, Any]) -> str | None:
    loc = [str(p) for p in err.get("loc", ())]
    path = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
    # A union (``"auto" | int``) adds the member that failed to the location: drop it.
    path = [p for p in path if not (p.startswith(_UNION_MEMBERS) or p in _UNION_SCALARS)]
    return ".".join(path) or None


def _reasons(errs: list[dict[str, Any]]) -> str:
    """One reason, or a union's: ``'auto', or Input should be greater than or equal to 1``."""
    texts = [str(e.get("msg", "invalid")).removeprefix("Value error, ") for e in errs]
    if len(texts) > 1 and texts[0].startswith("Input should be 'auto'"):
        return "use 'auto', or " + "; ".join(texts[1:])
    return "; ".join(dict.fromkeys(texts))


def _got(err: dict[str, Any]) -> str:
    value = err.get("input")
    return f" (got {value!r})" if isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 80 else ""


_UNION_MEMBERS = ("literal[", "constrained-", "function-")
_UNION_SCALARS = ("int", "float")
"""Whole names only: a prefix would drop fields such as ``integrations``."""
