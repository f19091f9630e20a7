"""A PostgreSQL connection of ftq finds out when its peer is gone (core.db.DEAD_PEER_S).

A worker machine that loses power mid-transaction sends no FIN. The server must drop that
backend, and with it the row locks its transaction holds, within seconds rather than the kernel's
two-hour keepalive default (or the ~15 min of retransmissions of a result the dead machine never
acknowledged), or every other machine's reaper blocks on the dead machine's job row
(the netns machine-loss test).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import make_url

from core.db import DEAD_PEER_S, UNACKED_MS, dispose_engine, make_engine


def test_both_ends_of_a_tcp_connection_drop_a_silent_or_unacknowledging_peer_within_a_minute(postgres_url: str) -> None:
    engine = make_engine(make_url(postgres_url).set(host="127.0.0.1").render_as_string(hide_password=False))
    try:
        with engine.connect() as conn:
            server = {k: conn.execute(text(f"SHOW tcp_keepalives_{k}")).scalar_one() for k in DEAD_PEER_S}
            unacked = conn.execute(text("SHOW tcp_user_timeout")).scalar_one()
            client = conn.connection.dbapi_connection.info.dsn
    finally:
        engine.dispose()
    assert server == {k: str(v) for k, v in DEAD_PEER_S.items()}, server
    assert unacked == str(UNACKED_MS) and f"tcp_user_timeout={UNACKED_MS}" in client, (unacked, client)
    assert "keepalives=1" in client and all(f"keepalives_{k}={v}" in client for k, v in DEAD_PEER_S.items()), client
    assert DEAD_PEER_S["idle"] + DEAD_PEER_S["interval"] * DEAD_PEER_S["count"] <= 60


def test_a_connection_a_thread_returns_after_the_engine_was_disposed_is_closed(postgres_url: str) -> None:
    """At shutdown the API disposes its engine while a request cancelled by uvicorn's grace may
    still run its query in a worker thread. ``engine.dispose()`` closes only the connections in
    the pool; the one that thread returns afterwards went into the discarded pool, open, and was
    closed by nobody: the garbage collector found it later, in whichever test ran then
    (psycopg's ResourceWarning, a red CI). ``dispose_engine`` closes it as it comes back."""
    import gc
    import warnings

    engine = make_engine(postgres_url)
    held = engine.connect()  # what the late request thread holds
    raw = held.connection.dbapi_connection
    dispose_engine(engine)
    held.close()  # the thread finishes and returns it
    assert raw.closed, "a connection returned after dispose was left open in the discarded pool"
    del held, raw
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()
    with engine.connect() as conn:  # the engine itself still works: its new pool is a normal one
        assert conn.execute(text("SELECT 1")).scalar_one() == 1
        fresh = conn.connection.dbapi_connection
    assert not fresh.closed, "the new pool closed a connection returned to it"
    engine.dispose()
