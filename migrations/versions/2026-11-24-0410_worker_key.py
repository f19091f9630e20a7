"""worker_key, worker.key_id, worker.address: workers on other machines (issue 17).

A worker key (``ftqw_<prefix>_<secret>``, stored hashed) lets a remote worker use only the
``/v1/worker/`` routes; ``worker.key_id`` says which key a worker runs with (None: a local
worker), ``worker.address`` where other machines reach it.

Revision ID: 4b7e2a91d0c3
Revises: 9d4b2e71c5a8
Create Date: 2026-11-24 04:10:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '4b7e2a91d0c3'
down_revision: str | Sequence[str] | None = '9d4b2e71c5a8'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('worker_key',
    sa.Column('worker_key_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('created_by', sa.String(length=40), nullable=True),
    sa.Column('revoked_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('last_used_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['created_by'], ['user.user_id'], name=op.f('fk_worker_key_created_by_user'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('worker_key_id', name=op.f('pk_worker_key')),
    sa.UniqueConstraint('name', name=op.f('uq_worker_key_name')),
    sa.UniqueConstraint('prefix', name=op.f('uq_worker_key_prefix'))
    )
    with op.batch_alter_table('worker', schema=None) as batch_op:
        batch_op.add_column(sa.Column('key_id', sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column('address', sa.String(length=255), nullable=True))
        batch_op.create_index(batch_op.f('ix_worker_key_id'), ['key_id'], unique=False)
        batch_op.create_foreign_key(batch_op.f('fk_worker_key_id_worker_key'), 'worker_key', ['key_id'], ['worker_key_id'], ondelete='SET NULL')


def downgrade() -> None:
    with op.batch_alter_table('worker', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_worker_key_id_worker_key'), type_='foreignkey')
        batch_op.drop_index(batch_op.f('ix_worker_key_id'))
        batch_op.drop_column('address')
        batch_op.drop_column('key_id')

    op.drop_table('worker_key')
