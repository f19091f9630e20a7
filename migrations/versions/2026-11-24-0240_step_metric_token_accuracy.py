"""step_metric.token_accuracy: the fraction of a step's target tokens the model ranked first.

The trainer's step event has ``token_accuracy`` (SFT; null for DPO); the row keeps it. Rows
written before have null.

Revision ID: 9d4b2e71c5a8
Revises: 7e1f0c2a9b41
Create Date: 2026-11-24 02:40:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '9d4b2e71c5a8'
down_revision: str | Sequence[str] | None = '7e1f0c2a9b41'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_accuracy', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.drop_column('token_accuracy')
