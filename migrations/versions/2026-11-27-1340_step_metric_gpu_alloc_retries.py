"""step_metric.gpu_alloc_retries: the CUDA caching allocator's retries during the step.

The trainer's step event has ``gpu_alloc_retries`` (each retry flushes the allocator's cache and
synchronizes the device: a step that stalls near the memory cap; summed over ranks, null without
CUDA); the row keeps it. Rows written before have null, as a CPU step does.

Revision ID: 6a4f2c8e1b37
Revises: 3c7d9e1f5a20
Create Date: 2026-11-27 13:40:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '6a4f2c8e1b37'
down_revision: str | Sequence[str] | None = '3c7d9e1f5a20'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpu_alloc_retries', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.drop_column('gpu_alloc_retries')
