"""``session_message`` ids never reused on SQLite (``AUTOINCREMENT``).

The relay's readers keep a watermark: the worker asks for requests past the last message id it
saw (``core.sessions.relay.pending``). Without ``AUTOINCREMENT`` SQLite gives a new row the
largest id in the table plus one, so once a request's rows were deleted (answered) the next
request could get an id at or below the worker's watermark and never reach the session: the
second message of a conversation on the embedded store waited forever. PostgreSQL's sequence
never goes back; nothing changes there.

SQLite: the table is copied in batch mode (nothing references it; its rows are carried over).

Revision ID: 9a4c2e7f1b30
Revises: 5d8e2a7c4b19
Create Date: 2026-11-28 03:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '9a4c2e7f1b30'
down_revision: str | Sequence[str] | None = '5d8e2a7c4b19'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _recreate(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table('session_message', recreate='always',
                              table_kwargs={'sqlite_autoincrement': autoincrement}):
        pass


def upgrade() -> None:
    _recreate(True)


def downgrade() -> None:
    _recreate(False)
