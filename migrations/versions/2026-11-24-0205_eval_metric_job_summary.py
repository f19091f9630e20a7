"""eval_metric rows; job.summary and job.preflight.

``eval_metric``: one row per validation pass of a job (the trainer's ``eval`` event), served by
``GET /v1/jobs/{id}/metrics`` beside the step rows. ``job.summary``: final/best train and eval
loss, trained tokens, skipped (non-finite) steps, kept current by the worker's recorder.
``job.preflight``: the submission-time dataset report (``core.jobs.preflight``) with its warnings.
Jobs written before have null for both.

Revision ID: 7e1f0c2a9b41
Revises: c6bcd56413f3
Create Date: 2026-11-24 02:05:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '7e1f0c2a9b41'
down_revision: str | Sequence[str] | None = 'c6bcd56413f3'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'eval_metric',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('loss', sa.Float(), nullable=True),
        sa.Column('tokens', sa.BigInteger(), nullable=True),
        sa.Column('time', core.db.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_eval_metric_job_id_job'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'step', name=op.f('pk_eval_metric')),
    )
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('summary', core.db.JSONType, nullable=True))
        batch_op.add_column(sa.Column('preflight', core.db.JSONType, nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), not batch mode: batch recreates the job
    # table on SQLite, and dropping the old one cascades to every job_event and step_metric row.
    op.drop_column('job', 'preflight')
    op.drop_column('job', 'summary')
    op.drop_table('eval_metric')
