"""Plain helpers the service tests share (data and functions, not fixtures; fixtures live in
the conftest.py files): a chat record, an API key made in a migrated store."""

from __future__ import annotations

CHAT_RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def create_api_key(database_url: str, name: str = "admin", *, is_admin: bool = True) -> str:
    """Create user ``name`` in the (migrated) store at ``database_url``; returns its API key."""
    from core.db import make_engine, make_sessionmaker
    from core.users.service import create_user_with_key

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            _user, issued = create_user_with_key(session, name, is_admin=is_admin)
            session.commit()
            return issued.secret
    finally:
        engine.dispose()
