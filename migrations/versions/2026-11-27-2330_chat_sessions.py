"""chat sessions: ``session_message`` (the relay between the API and a session's worker) and a
``job.training_file_id`` that may be null (a job of kind ``session`` reads no file).

SQLite: changing a column's nullability needs batch mode, a copy of ``job``; with ``foreign_keys``
on, dropping the old copy would run its ``ON DELETE CASCADE`` (every job event gone), so both
directions switch it off first, as the projects migration does, and check the keys afterwards.
The downgrade refuses while a session job exists (its null file would not fit the column).

Revision ID: 7c2d9e4a1f60
Revises: e4a1c7b9d2f0
Create Date: 2026-11-27 23:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '7c2d9e4a1f60'
down_revision: str | Sequence[str] | None = 'e4a1c7b9d2f0'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    _foreign_keys_off()
    op.create_table('session_message',
    sa.Column('message_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('request_id', sa.String(length=40), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('body', core.db.JSONType, nullable=False),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_session_message_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('message_id', name=op.f('pk_session_message'))
    )
    with op.batch_alter_table('session_message', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_session_message_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_session_message_request_id'), ['request_id'], unique=False)
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.alter_column('training_file_id', existing_type=sa.String(length=40), nullable=True)
    _check_foreign_keys()


def downgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT count(*) FROM job WHERE training_file_id IS NULL")).scalar():
        raise RuntimeError('session jobs exist (no training file): delete them before downgrading')
    _foreign_keys_off()
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.alter_column('training_file_id', existing_type=sa.String(length=40), nullable=False)
    with op.batch_alter_table('session_message', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_session_message_request_id'))
        batch_op.drop_index(batch_op.f('ix_session_message_job_id'))
    op.drop_table('session_message')
    _check_foreign_keys()


def _foreign_keys_off() -> None:
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        return
    bind.exec_driver_sql('PRAGMA foreign_keys=OFF')
    if bind.exec_driver_sql('PRAGMA foreign_keys').scalar():
        raise RuntimeError(
            'SQLite kept foreign_keys on (a transaction was open), so copying the job table would delete '
            'its events; run this migration on its own: ftq db upgrade'
        )


def _check_foreign_keys() -> None:
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        return
    broken = bind.exec_driver_sql('PRAGMA foreign_key_check').fetchall()
    if broken:
        raise RuntimeError(f'the chat sessions migration left rows whose foreign keys point at nothing: {broken[:5]}')
