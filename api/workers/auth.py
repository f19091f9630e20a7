"""Who is calling a ``/v1/worker/`` route: a worker key, and nothing else.

``api.auth.AuthGate`` sends every request under ``WORKER_PREFIX`` here and every other request to
the users' check, which refuses worker keys (403). So a worker key reads no user's route, and a
user's key (an admin's included) moves no bytes in or out of a job's artifact store. Worker routes
take the key from the ``Authorization`` header only: the dashboard's cookie never counts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from anyio import to_thread
from fastapi import Depends, Request

from core.errors import Forbidden, Unauthenticated
from core.users.service import split_key
from core.workers.keys import is_worker_key, verify_worker_key

WORKER_PREFIX = "/v1/worker/"
WORKER_ONLY = "worker keys are allowed only on /v1/worker/ routes; use a user's API key (ftq_...) here"


@dataclass(frozen=True)
class WorkerCaller:
    """A verified worker key: a snapshot, detached from any session."""

    worker_key_id: str
    name: str
    prefix: str


def is_worker_path(path: str) -> bool:
    """Whether ``path`` (as ``api.auth.app_path`` gives it) is a worker route's."""
    return path.startswith(WORKER_PREFIX) or path == WORKER_PREFIX.rstrip("/")


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("Authorization: use the form 'Bearer <worker key>'", param="Authorization")
    return token.strip()


async def authenticate_worker(request: Request) -> WorkerCaller:
    """Verify the request's worker key (once per request) and return it.

    Raises:
        Unauthenticated: no key, or a malformed, unknown or revoked worker key.
        Forbidden: a user's API key, good or not (worker routes take worker keys only).
    """
    known = getattr(request.state, "worker", None)
    if isinstance(known, WorkerCaller):
        return known
    raw = bearer_token(request)
    if raw is None:
        raise Unauthenticated(
            "worker routes need a worker key: send 'Authorization: Bearer ftqw_...' (the worker reads "
            "FTQ_WORKER_KEY); an admin makes one with `ftq workers key create NAME`",
            param="Authorization",
        )
    if not is_worker_key(raw) and split_key(raw) is not None:
        raise Forbidden(
            "only worker keys (ftqw_...) may use /v1/worker/ routes, not a user's API key; an admin makes "
            "one with `ftq workers key create NAME`",
            param="Authorization",
        )
    state = request.state.ftq

    def verify() -> WorkerCaller:
        with state.sessions() as session:
            row = verify_worker_key(session, raw)
            caller = WorkerCaller(worker_key_id=row.worker_key_id, name=row.name, prefix=row.prefix)
            session.commit()
            return caller

    caller = await to_thread.run_sync(verify)
    request.state.worker = caller
    return caller


def refuse_worker_key(raw: str) -> None:
    """Raise Forbidden if ``raw`` is a worker key: it is shown on a route that is not a worker's."""
    if is_worker_key(raw):
        raise Forbidden(WORKER_ONLY, param="Authorization")


WorkerDep = Annotated[WorkerCaller, Depends(authenticate_worker)]
