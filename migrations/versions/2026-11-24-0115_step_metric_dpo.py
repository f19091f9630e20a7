"""step_metric: the DPO step fields (reward_margin, reward_accuracy, chosen_logp, rejected_logp).

A DPO run's step event carries them (trainer.events.DPO_STEP_FIELDS); SFT steps and rows
written before have null.

Revision ID: fa2c176b654e
Revises: bc26b755fc0d
Create Date: 2026-11-24 01:15:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = 'fa2c176b654e'
down_revision: str | Sequence[str] | None = 'bc26b755fc0d'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ('reward_margin', 'reward_accuracy', 'chosen_logp', 'rejected_logp')


def upgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
