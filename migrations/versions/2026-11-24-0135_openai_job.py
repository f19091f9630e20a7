"""openai_job: the OpenAI-compatible API's fields of a job (suffix, metadata, method, pause).

One row per job submitted through ``/openai/v1``; the job itself stays an ordinary ``job`` row.

Revision ID: 3c1f0a9e7b21
Revises: fa2c176b654e
Create Date: 2026-11-24 01:35:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '3c1f0a9e7b21'
down_revision: str | Sequence[str] | None = 'fa2c176b654e'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'openai_job',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('suffix', sa.String(length=64), nullable=True),
        sa.Column('user_metadata', core.db.JSONType, nullable=True),
        sa.Column('method', core.db.JSONType, nullable=False),
        sa.Column('training_file', sa.String(length=40), nullable=False),
        sa.Column('validation_file', sa.String(length=40), nullable=True),
        sa.Column('paused_at', core.db.UTCDateTime(), nullable=True),
        sa.Column('created_at', core.db.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_openai_job_job_id_job'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', name=op.f('pk_openai_job')),
    )


def downgrade() -> None:
    op.drop_table('openai_job')
