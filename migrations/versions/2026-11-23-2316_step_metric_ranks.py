"""step_metric.ranks: per-rank step time and memory of a multi-GPU job's step.

The trainer's step event has ``ranks`` (a list of per-rank dicts under torchrun, null for one
rank); the row keeps it as JSON. Rows written before have null, as a one-rank step does.

Revision ID: bc26b755fc0d
Revises: eb08eb1d831b
Create Date: 2026-11-23 23:16:26.324027+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = 'bc26b755fc0d'
down_revision: str | Sequence[str] | None = 'eb08eb1d831b'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ranks', core.db.JSONType, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.drop_column('ranks')
