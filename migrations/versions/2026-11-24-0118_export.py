"""export: one row per export of a finished job (merged safetensors or GGUF), run by a worker.

Revision ID: c6bcd56413f3
Revises: 3c1f0a9e7b21
Create Date: 2026-11-24 01:18:30.015637+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = 'c6bcd56413f3'
down_revision: str | Sequence[str] | None = '3c1f0a9e7b21'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('export',
    sa.Column('export_id', sa.String(length=40), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('format', sa.String(length=16), nullable=False),
    sa.Column('quantization', sa.String(length=16), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('stage', sa.String(length=16), nullable=True),
    sa.Column('progress', sa.Float(), nullable=False),
    sa.Column('owner_id', sa.String(length=40), nullable=True),
    sa.Column('worker_id', sa.String(length=200), nullable=True),
    sa.Column('path', sa.String(length=1024), nullable=True),
    sa.Column('bytes', sa.BigInteger(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('started_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_export_job_id_job'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['owner_id'], ['user.user_id'], name=op.f('fk_export_owner_id_user'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('export_id', name=op.f('pk_export'))
    )
    with op.batch_alter_table('export', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_export_job_id'), ['job_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('export', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_export_job_id'))

    op.drop_table('export')
