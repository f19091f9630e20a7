"""Alembic environment for the ftq store.

The URL comes from, in order: a connection handed over by ``core.migrate`` (tests, ``ftq``),
``config.attributes["database_url"]``, ``-x database_url=...``, then the FTQ settings
(``FTQ_DATABASE_URL``, else SQLite under ``FTQ_DATA_DIR``). Batch mode is on so ALTERs work
on SQLite, which cannot alter most of a table in place.
"""

from __future__ import annotations

import logging.config

from alembic import context
from sqlalchemy import Connection

from core.db import make_engine
from core.models import metadata

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("database_url")
    if url:
        return url
    from core.settings import Settings

    return Settings().resolved().database_url  # type: ignore[return-value]


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,
        compare_type=True,
        compare_server_default=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=_database_url(),
        target_metadata=metadata,
        render_as_batch=True,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    engine = make_engine(_database_url())
    try:
        with engine.connect() as conn:
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
