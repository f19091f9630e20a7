"""Worker keys: what a worker on another machine shows the API. Create, list, revoke, verify;
each takes a session and the caller commits.

A worker key reads ``ftqw_<prefix>_<secret>`` (a scheme distinct from users' ``ftq_`` keys, so
the API tells the two apart before any lookup): ``prefix`` is 8 hex characters, unique, stored
in clear; ``secret`` is 32 random bytes. The store keeps only the SHA-256 of the whole key, as
for users' keys (``core.users.service``). A worker key is allowed only on the ``/v1/worker/``
routes (``api.auth``); revoking it ends that worker's transfers (401) and claims.
"""

from __future__ import annotations

import datetime as dt
import hmac
import secrets

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, InvalidInput, NotFound, Unauthenticated
from core.users.service import NAME_PATTERN, hash_key, public_key_id, split_key
from core.workers.models import Worker, WorkerKey

KEY_SCHEME = "ftqw"
PREFIX_HEX = 8
SECRET_BYTES = 32
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


def is_worker_key(raw: str) -> bool:
    """Whether ``raw`` is written in the worker keys' scheme (well formed or not)."""
    return raw.strip().startswith(KEY_SCHEME + "_")


def split_worker_key(raw: str) -> tuple[str, str] | None:
    """``(prefix, secret)`` of a well-formed worker key, else None (the users' key shape, its own scheme)."""
    return split_key(raw, expected=KEY_SCHEME)


def check_key_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise InvalidInput(
            f"name: {name!r} is not a worker key name; use 1-64 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (the machine's name is a good choice)",
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
    for _ in range(5):  # 8 hex chars: a prefix collision is rare, but it is a unique column
        prefix = secrets.token_hex(PREFIX_HEX // 2)
        if session.scalar(select(WorkerKey.worker_key_id).where(WorkerKey.prefix == prefix)) is None:
            break
    else:  # pragma: no cover - five collisions in a row means the random source is broken
        raise RuntimeError("could not find an unused worker key prefix")
    raw = f"{KEY_SCHEME}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    row = WorkerKey(
        worker_key_id=new_id("wkey"), name=name, prefix=prefix, key_hash=hash_key(raw),
        created_at=utcnow(), created_by=created_by,
    )
    session.add(row)
    try:
        session.flush()
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
    row = session.scalar(select(WorkerKey).where(WorkerKey.name == name_or_prefix)) or session.scalar(
        select(WorkerKey).where(WorkerKey.prefix == name_or_prefix)
    ) or session.get(WorkerKey, name_or_prefix)
    if row is None:
        raise NotFound(
            f"no worker key {name_or_prefix!r}; give its name or prefix, see GET /v1/workers/keys "
            "(or `ftq workers key list`)",
            param="name",
        )
    return row


def revoke_worker_key(session: Session, name_or_prefix: str) -> WorkerKey:
    """Revoke a worker key (idempotent: a revoked key keeps its first revocation time)."""
    row = find_worker_key(session, name_or_prefix)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
    return row


def verify_worker_key(session: Session, raw: str) -> WorkerKey:
    """The worker key ``raw`` is; the caller commits (``last_used_at`` may have moved).

    Raises:
        Unauthenticated: a malformed, unknown or revoked worker key; the message says which.
    """
    raw = raw.strip()
    parts = split_worker_key(raw)
    if parts is None:
        raise Unauthenticated(
            "the worker key is malformed: worker keys look like ftqw_<8 hex>_<secret>; copy the whole key "
            "(an admin makes one with `ftq workers key create NAME`)",
            param="Authorization",
        )
    row = session.scalar(select(WorkerKey).where(WorkerKey.prefix == parts[0]))
    # Compare against a hash even when no key has this prefix, so timing says nothing.
    expected = row.key_hash if row is not None else hash_key("")
    if not hmac.compare_digest(hash_key(raw), expected) or row is None:
        raise Unauthenticated(
            "the worker key is not valid; check FTQ_WORKER_KEY was copied whole, or ask an admin for a new one",
            param="Authorization", key_id=None if row is None else public_key_id(KEY_SCHEME, row.prefix),
        )
    if row.revoked_at is not None:
        raise Unauthenticated(
            f"the worker key {row.name!r} ({row.prefix}) was revoked at {row.revoked_at.isoformat()}; "
            "ask an admin for a new one (`ftq workers key create NAME`)",
            param="Authorization", key_id=public_key_id(KEY_SCHEME, row.prefix),
        )
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        session.execute(
            update(WorkerKey)
            .where(WorkerKey.worker_key_id == row.worker_key_id)
            .values(last_used_at=now)
            .execution_options(synchronize_session=False)
        )
    return row


def worker_key_active(session: Session, raw: str) -> WorkerKey | None:
    """The worker key ``raw`` is if it is good now (not revoked), else None: the claim's check."""
    try:
        return verify_worker_key(session, raw)
    except Unauthenticated:
        return None
