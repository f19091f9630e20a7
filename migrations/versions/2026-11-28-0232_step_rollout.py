"""step_rollout rows: the rollouts shown for each GRPO step.

``step_rollout``: one row per step of a GRPO job, its first ``grpo.log_rollouts`` completions with
their rewards and scores by grader (the trainer's ``rollouts`` event), served by
``GET /v1/jobs/{id}/rollouts`` and shown on the job page. Jobs written before have none.

Revision ID: 5d8e2a7c4b19
Revises: 5e8c1a7d3b92
Create Date: 2026-11-28 02:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '5d8e2a7c4b19'
down_revision: str | Sequence[str] | None = '5e8c1a7d3b92'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'step_rollout',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('rollouts', core.db.JSONType, nullable=False),
        sa.Column('time', core.db.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_step_rollout_job_id_job'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'step', name=op.f('pk_step_rollout')),
    )


def downgrade() -> None:
    op.drop_table('step_rollout')
