"""project.tracking_servers: the box's tracking servers a project's jobs may send to.

A JSON list of server names (``FTQ_TRACKING_SERVERS`` plus the implicit ``mlflow``/``wandb``);
NULL, what every existing project gets, means all of the box's, as before. The downgrade drops
the column and keeps every project, member and piece of work.

SQLite drops a column by copying the table (batch mode). ``project`` is what ``project_member``
(ON DELETE CASCADE), ``user``/``api_key`` (SET NULL) and ``file``/``job``/``export`` (RESTRICT)
point at, so dropping its old copy with ``foreign_keys`` on would delete every membership, clear
every default project or fail: both directions switch it off first and run
``PRAGMA foreign_key_check`` at the end, as the projects migration does.

Revision ID: 8f3b6a2d9e14
Revises: 5d2e8b7c41a9
Create Date: 2026-11-27 08:15:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '8f3b6a2d9e14'
down_revision: str | Sequence[str] | None = '5d2e8b7c41a9'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _foreign_keys_off()
    with op.batch_alter_table('project', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tracking_servers', core.db.JSONType, nullable=True))
    _check_foreign_keys()


def downgrade() -> None:
    _foreign_keys_off()
    with op.batch_alter_table('project', schema=None) as batch_op:
        batch_op.drop_column('tracking_servers')
    _check_foreign_keys()


def _foreign_keys_off() -> None:
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        return
    bind.exec_driver_sql('PRAGMA foreign_keys=OFF')
    if bind.exec_driver_sql('PRAGMA foreign_keys').scalar():
        raise RuntimeError(
            'SQLite kept foreign_keys on (a transaction was open), so copying the project table would '
            'delete its members; run this migration on its own: ftq db upgrade'
        )


def _check_foreign_keys() -> None:
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        return
    broken = bind.exec_driver_sql('PRAGMA foreign_key_check').fetchall()
    if broken:
        raise RuntimeError(f'the project tracking_servers migration left rows whose foreign keys point at nothing: {broken[:5]}')
