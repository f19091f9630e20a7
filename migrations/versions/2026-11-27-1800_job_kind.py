"""job.kind: ``train`` (a fine-tuning job) or ``generate`` (a batch generation job, issue 26).

A generation job's spec is ``core.jobs.generate_spec.GenerateSpec``; it keeps its prompts file in
``training_file_id`` (the job's input file, protected from deletion while the job is active like
a dataset) and ``generate`` in ``method``. Rows written before are training jobs.

Revision ID: 9b1e5d7c3a42
Revises: 6a4f2c8e1b37
Create Date: 2026-11-27 18:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '9b1e5d7c3a42'
down_revision: str | Sequence[str] | None = '6a4f2c8e1b37'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('job', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=16), server_default='train', nullable=False))


def downgrade() -> None:
    # Not a batch operation: on SQLite a batch copies the job table and drops the old one, which
    # deletes every job_event row by its ON DELETE CASCADE; DROP COLUMN (SQLite 3.35+) does not.
    op.drop_column('job', 'kind')
