"""gpu_slot: each worker host's pool of GPUs, one row per (worker, slot), and the job holding it.

A multi-GPU job holds all its GPUs on one host: the claim reserves them (``job_id``) in the
same transaction that moves the job to ``running``, and the transaction that ends the run
releases them. Workers write their rows when they register; no data to move.

Revision ID: eb08eb1d831b
Revises: 5d1c0b7e9a42
Create Date: 2026-11-23 23:11:26.128529+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = 'eb08eb1d831b'
down_revision: str | Sequence[str] | None = '5d1c0b7e9a42'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('gpu_slot',
    sa.Column('worker_id', sa.String(length=200), nullable=False),
    sa.Column('slot', sa.Integer(), nullable=False),
    sa.Column('device', sa.String(length=64), nullable=True),
    sa.Column('job_id', sa.String(length=40), nullable=True),
    sa.Column('reserved_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_gpu_slot_job_id_job'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['worker_id'], ['worker.worker_id'], name=op.f('fk_gpu_slot_worker_id_worker'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('worker_id', 'slot', name=op.f('pk_gpu_slot'))
    )
    with op.batch_alter_table('gpu_slot', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_gpu_slot_job_id'), ['job_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('gpu_slot', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_gpu_slot_job_id'))

    op.drop_table('gpu_slot')
