"""Worker keys: what a worker on another machine shows the API. Create, list, revoke, verify;
each takes a session and the caller commits.

A worker key reads ``ftqw_<prefix>_<secret>``, a scheme distinct from users' ``ftq_`` keys, so
the API tells the two apart before any lookup; minting, finding, verifying and revoking it is
``core.keys``' (the same as for users' keys) with the scheme ``WORKER_KEYS``. A worker key is
allowed only on the ``/v1/worker/`` routes (``api.auth``); revoking it ends that worker's
transfers (401) and claims.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import keys
from core.errors import Conflict, InvalidInput, Unauthenticated
from core.names import NAME_PATTERN, NAME_RULE
from core.workers.models import Worker, WorkerKey

KEY_SCHEME = "ftqw"
WORKER_KEYS = keys.KeyScheme(
    scheme=KEY_SCHEME, model=WorkerKey, id_column="worker_key_id", id_prefix="wkey",
    lookup=("name", "prefix", "worker_key_id"),
    malformed="the worker key is malformed: worker keys look like ftqw_<8 hex>_<secret>; copy the whole key "
              "(an admin makes one with `ftq workers key create NAME`)",
    invalid="the worker key is not valid; check FTQ_WORKER_KEY was copied whole, or ask an admin for a new one",
    revoked="the worker key {key.name!r} ({key.prefix}) was revoked at {at}; "
            "ask an admin for a new one (`ftq workers key create NAME`)",
    not_found="no worker key {wanted!r}; give its name or prefix, see GET /v1/workers/keys "
              "(or `ftq workers key list`)",
    not_found_param="name",
)


def is_worker_key(raw: str) -> bool:
    """Whether ``raw`` is written in the worker keys' scheme (well formed or not)."""
    return raw.strip().startswith(KEY_SCHEME + "_")


def split_worker_key(raw: str) -> tuple[str, str] | None:
    """``(prefix, secret)`` of a well-formed worker key, else None (the users' key shape, its own scheme)."""
    return keys.split_key(raw, expected=KEY_SCHEME)


def check_key_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise InvalidInput(
            f"name: {name!r} is not a worker key name; use {NAME_RULE} (the machine's name is a good choice)",
            param="name",
        )
    return name


def create_worker_key(session: Session, name: str, *, created_by: str | None) -> tuple[WorkerKey, str]:
    """A new worker key named ``name``; the returned raw key is its only copy.

    Raises:
        InvalidInput: ``name`` is not a key name.
        Conflict: a worker key (revoked or not) has this name.
    """
    check_key_name(name)
    if session.scalar(select(WorkerKey.worker_key_id).where(WorkerKey.name == name)) is not None:
        raise Conflict(
            f"name: a worker key named {name!r} exists; pick another name, or revoke it and use a new name",
            param="name",
        )
    try:
        row, raw = keys.mint(session, WORKER_KEYS, name=name, created_by=created_by)
    except IntegrityError:
        session.rollback()
        raise Conflict(f"name: a worker key named {name!r} exists; pick another name", param="name") from None
    return row, raw


def list_worker_keys(session: Session) -> list[WorkerKey]:
    return list(session.scalars(select(WorkerKey).order_by(WorkerKey.created_at, WorkerKey.name)))


def workers_by_key(session: Session, key_ids: set[str]) -> dict[str, list[str]]:
    """``{worker_key_id: [worker_id, ...]}``: the workers that reported each key (one query)."""
    if not key_ids:
        return {}
    found: dict[str, list[str]] = {k: [] for k in key_ids}
    rows = session.execute(
        select(Worker.key_id, Worker.worker_id).where(Worker.key_id.in_(key_ids)).order_by(Worker.worker_id)
    )
    for key_id, worker_id in rows:
        found[key_id].append(worker_id)
    return found


def find_worker_key(session: Session, name_or_prefix: str) -> WorkerKey:
    """A worker key by its name, its prefix (8 hex after ``ftqw_``) or its id (``wkey-...``)."""
    return keys.find(session, WORKER_KEYS, name_or_prefix)


def revoke_worker_key(session: Session, name_or_prefix: str) -> WorkerKey:
    """Revoke a worker key (idempotent: a revoked key keeps its first revocation time)."""
    return keys.revoke(session, find_worker_key(session, name_or_prefix))


def verify_worker_key(session: Session, raw: str) -> WorkerKey:
    """The worker key ``raw`` is; the caller commits (``last_used_at`` may have moved).

    Raises:
        Unauthenticated: a malformed, unknown or revoked worker key; the message says which.
    """
    row = keys.check(session, WORKER_KEYS, raw)
    keys.touch(session, WORKER_KEYS, row)
    return row


def worker_key_active(session: Session, raw: str) -> WorkerKey | None:
    """The worker key ``raw`` is if it is good now (not revoked), else None: the claim's check."""
    try:
        return verify_worker_key(session, raw)
    except Unauthenticated:
        return None
