"""API keys of both kinds, users' (``ftq_``) and workers' (``ftqw_``): one wire format and one
way to mint, find, verify and revoke them. A ``KeyScheme`` says which kind: its scheme word,
its table, and the words its messages use. Each function takes a session; the caller commits.

A key reads ``<scheme>_<prefix>_<secret>``: ``prefix`` is 8 hex characters, unique, stored in
clear so a key can be found (and named: ``ftq users revoke PREFIX``) without a scan; ``secret``
is 32 random bytes (URL-safe base64). The store keeps only the SHA-256 of the whole key, so a
copy of the database lets nobody in. The schemes differ, so the API tells a worker key from a
user's before any lookup. Verification compares hashes in constant time (also when no key has
the prefix), and ``touch`` records ``last_used_at`` at most once a minute so every request is
not a write.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import NotFound, Unauthenticated

PREFIX_HEX = 8
SECRET_BYTES = 32
LAST_USED_RESOLUTION = dt.timedelta(minutes=1)


@dataclass(frozen=True)
class KeyScheme:
    """One kind of key. The message templates are ``str.format``-ed with ``key`` (the row),
    ``at`` (its revocation time) and ``wanted`` (what ``find`` was given)."""

    scheme: str
    """The key's first word: ``ftq`` (users), ``ftqw`` (workers)."""
    model: Any
    """The table's model (``ApiKey``, ``WorkerKey``): ``prefix``, ``key_hash``, ``created_at``,
    ``last_used_at``, ``revoked_at`` and the id column ``id_column``."""
    id_column: str
    id_prefix: str
    """What the row ids start with (``core.db.new_id``): ``key``, ``wkey``."""
    lookup: tuple[str, ...]
    """The columns ``find`` tries, in order, for the name an admin types."""
    malformed: str
    invalid: str
    revoked: str
    not_found: str
    not_found_param: str


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def split_key(raw: str, *, expected: str) -> tuple[str, str] | None:
    """``(prefix, secret)`` of a well-formed key of scheme ``expected``, else None."""
    scheme, sep, rest = raw.partition("_")
    prefix, sep2, secret = rest.partition("_")
    if scheme != expected or not sep or not sep2 or len(prefix) != PREFIX_HEX or not secret:
        return None
    if any(c not in "0123456789abcdef" for c in prefix):
        return None
    return prefix, secret


def public_key_id(scheme: str, prefix: str) -> str:
    """A key's public id, ``<scheme>_<prefix>`` (``ftq_1a2b3c4d``; a worker key's ``ftqw_…``):
    not secret, it names the key in the log and is what ``api.auth_throttle`` counts failures by."""
    return f"{scheme}_{prefix}"


def mint(session: Session, kind: KeyScheme, **columns: Any) -> tuple[Any, str]:
    """A new row of ``kind`` with ``columns`` (its owner, name...), added and flushed, and the raw
    key (its only copy)."""
    model = kind.model
    for _ in range(5):  # 8 hex chars: a prefix collision is rare, but it is a unique column
        prefix = secrets.token_hex(PREFIX_HEX // 2)
        if session.scalar(select(getattr(model, kind.id_column)).where(model.prefix == prefix)) is None:
            break
    else:  # pragma: no cover - five collisions in a row means the random source is broken
        raise RuntimeError(f"could not find an unused {kind.scheme}_ key prefix")
    raw = f"{kind.scheme}_{prefix}_{secrets.token_urlsafe(SECRET_BYTES)}"
    row = model(**{kind.id_column: new_id(kind.id_prefix)}, prefix=prefix, key_hash=hash_key(raw),
                created_at=utcnow(), **columns)
    session.add(row)
    session.flush()
    return row, raw


def find(session: Session, kind: KeyScheme, wanted: str) -> Any:
    """The key an admin names by any of ``kind.lookup`` (id, prefix, name).

    Raises:
        NotFound: no key of this kind is named so.
    """
    model = kind.model
    for column in kind.lookup:
        row = session.scalar(select(model).where(getattr(model, column) == wanted))
        if row is not None:
            return row
    raise NotFound(kind.not_found.format(wanted=wanted), param=kind.not_found_param)


def revoke(session: Session, row: Any) -> Any:
    """Revoke ``row`` (idempotent: a revoked key keeps its first revocation time)."""
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
    return row


def check(session: Session, kind: KeyScheme, raw: str) -> Any:
    """The row of a good key ``raw`` of ``kind``; writes nothing (``touch`` does).

    Raises:
        Unauthenticated: a malformed, unknown or revoked key; the message says which and what to
            do, never anything about other keys.
    """
    raw = raw.strip()
    parts = split_key(raw, expected=kind.scheme)
    if parts is None:
        raise Unauthenticated(kind.malformed, param="Authorization")
    row = session.scalar(select(kind.model).where(kind.model.prefix == parts[0]))
    # Compare against a hash even when no key has this prefix, so timing says nothing.
    expected = row.key_hash if row is not None else hash_key("")
    if not hmac.compare_digest(hash_key(raw), expected) or row is None:
        raise Unauthenticated(kind.invalid, param="Authorization",
                              key_id=None if row is None else public_key_id(kind.scheme, row.prefix))
    if row.revoked_at is not None:
        raise Unauthenticated(kind.revoked.format(key=row, at=row.revoked_at.isoformat()), param="Authorization",
                              key_id=public_key_id(kind.scheme, row.prefix))
    return row


def touch(session: Session, kind: KeyScheme, row: Any) -> None:
    """Record that ``row`` was used now, unless that was recorded less than a minute ago."""
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        id_column = getattr(kind.model, kind.id_column)
        session.execute(
            update(kind.model)
            .where(id_column == getattr(row, kind.id_column))
            .values(last_used_at=now)
            .execution_options(synchronize_session=False)
        )
