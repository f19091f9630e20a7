"""Store plumbing: the declarative base with one naming convention, engines and sessions.

Nothing is created at import; ``make_engine`` is called by the API lifespan, the worker's
process init and the CLI. SQLite (the embedded default) gets WAL mode and a busy timeout so
the API and the worker can share one file.
"""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import JSON, DateTime, Engine, MetaData, create_engine, event, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, sessionmaker
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JSONType = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use core.db.utcnow()")
        return value.astimezone(dt.UTC) if value is not None else None

    def process_result_value(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_id(prefix: str) -> str:
    """Public ids look like ``job-3f9c...``: a type prefix and 24 hex characters."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


POOL = {"pool_size": 10, "max_overflow": 40}
"""Up to 50 connections: more than the 40 threads anyio runs sync work in (each may hold one),
so a request never waits 30 s for a pooled connection and fails (issue 10: SQLAlchemy's default
5 + 10 under 20 submissions/s beside 100 viewers)."""


DEAD_PEER_S = {"idle": 10, "interval": 5, "count": 4}
"""TCP keepalive for PostgreSQL connections, both ends: a peer silent this long (10 s idle, then 4
probes 5 s apart: 30 s) is dead. A worker machine that loses power or its network mid-transaction
sends no FIN; without this the server would keep its backend, its open transaction and the row
locks it holds (the job row a runner locked, the worker row presence locked) for the kernel's
default two hours, and every other machine's reaper would block on them. The client end lets a
worker whose database host vanished fail its query instead of waiting as long."""

UNACKED_MS = 30_000
"""``tcp_user_timeout``, both ends: data sent but not acknowledged for 30 s ends the connection.
Keepalive probes only start on a connection with nothing in flight; a machine that died just
after the server sent it a result leaves that result unacknowledged, and the kernel then
retransmits for about 15 minutes (``tcp_retries2``) with the locks held (seen in the netns
machine-loss test: the dead machine's session ``idle in transaction`` 5 min later, the survivor's
reaper waiting on its lock)."""


def _postgres_connect_args() -> dict[str, object]:
    server = " ".join([f"-c tcp_keepalives_{k}={v}" for k, v in DEAD_PEER_S.items()]
                      + [f"-c tcp_user_timeout={UNACKED_MS}"])
    client = {"keepalives": 1, **{f"keepalives_{k}": v for k, v in DEAD_PEER_S.items()},
              "tcp_user_timeout": UNACKED_MS}
    return {"options": server, **client}


def make_engine(url: str, *, echo: bool = False) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, echo=echo, connect_args={"timeout": 30, "check_same_thread": False}, **POOL)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, echo=echo, pool_pre_ping=True, connect_args=_postgres_connect_args(), **POOL)


def dispose_engine(engine: Engine) -> None:
    """``engine.dispose()``, and each connection checked out then is closed when it comes back.

    ``Engine.dispose`` closes the connections in the pool and swaps in a new pool; a connection a
    thread still holds (a request uvicorn cancelled at shutdown whose query runs on in an anyio
    worker thread, a presence thread mid-write) is returned later into the discarded pool, open,
    where nothing closes it: PostgreSQL keeps the backend until the process ends and the garbage
    collector finds the open psycopg connection in some later, unrelated code. The engine stays
    usable: its new pool is untouched.
    """
    discarded = engine.pool
    engine.dispose()
    event.listen(discarded, "checkin", _close_on_return)
    discarded.dispose()  # one returned between the two lines above


def _close_on_return(dbapi_connection: object, _record: object) -> None:
    if dbapi_connection is not None:
        dbapi_connection.close()  # type: ignore[attr-defined]


def make_sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)


def ping(engine: Engine) -> None:
    """One round trip to the store (``SELECT 1``); raises what the driver raises when it is down."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
