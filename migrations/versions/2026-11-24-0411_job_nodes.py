"""job.nodes and job_node: jobs that span machines.

``job.nodes`` is how many machines a job's GPUs are spread over (``gpus / nodes`` each; 1 for
every job before). ``job_node`` has one row per machine of each attempt of a multi-machine job:
which worker host runs node rank ``node_rank``, at which address, the rendezvous endpoint its
torchrun meets the others at, and when and how its part ended. Jobs on one machine have none.

Revision ID: 3c7a9e51f2d0
Revises: 4b7e2a91d0c3
Create Date: 2026-11-24 04:11:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '3c7a9e51f2d0'
down_revision: str | Sequence[str] | None = '4b7e2a91d0c3'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('nodes', sa.Integer(), server_default='1', nullable=False))
    op.create_table('job_node',
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('node_rank', sa.Integer(), nullable=False),
    sa.Column('worker_id', sa.String(length=200), nullable=False),
    sa.Column('address', sa.String(length=255), nullable=False),
    sa.Column('rdzv_endpoint', sa.String(length=300), nullable=False),
    sa.Column('started_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('ended_at', core.db.UTCDateTime(timezone=True), nullable=True),
    sa.Column('returncode', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_job_node_job_id_job'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'attempt', 'node_rank', name=op.f('pk_job_node'))
    )
    with op.batch_alter_table('job_node', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_job_node_worker_id'), ['worker_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('job_node', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_job_node_worker_id'))
    op.drop_table('job_node')
    # Not a batch operation: on SQLite a batch copies the job table and drops the old one, which
    # deletes every job_event row by its ON DELETE CASCADE; DROP COLUMN (SQLite 3.35+) does not.
    op.drop_column('job', 'nodes')
