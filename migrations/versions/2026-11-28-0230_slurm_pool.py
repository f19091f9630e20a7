"""named pools: ``job.pool`` (the pool a job asks for, e.g. ``slurm``) and ``worker.pool`` (the
pool a host serves: a Slurm bridge's), both nullable (None: ftq's own worker hosts).

Revision ID: 5d3f8a2c6b17
Revises: 7c2d9e4a1f60
Create Date: 2026-11-28 02:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '5d3f8a2c6b17'
down_revision: str | Sequence[str] | None = '7c2d9e4a1f60'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('job', sa.Column('pool', sa.String(length=64), nullable=True))
    op.add_column('worker', sa.Column('pool', sa.String(length=64), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), not batch mode: batch copies the table, and
    # dropping the old ``job`` (``worker``) with foreign keys on deletes every row that cascades from it
    op.drop_column('worker', 'pool')
    op.drop_column('job', 'pool')
