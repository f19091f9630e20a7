"""eval and eval_run: evals (an item schema and testing criteria) and their runs (issue 27).

A run's work is a job of kind ``eval`` (``core.jobs.eval_spec``); ``eval_run.job_id`` names it,
and deleting the job deletes the run. Deleting an eval deletes its runs' rows (their jobs stay).

Revision ID: e4a1c7b9d2f0
Revises: 9b1e5d7c3a42
Create Date: 2026-11-27 23:13:27.232629+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = 'e4a1c7b9d2f0'
down_revision: str | Sequence[str] | None = '9b1e5d7c3a42'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('eval',
    sa.Column('eval_id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('user_metadata', core.db.JSONType, nullable=True),
    sa.Column('item_schema', core.db.JSONType, nullable=False),
    sa.Column('include_sample_schema', sa.Boolean(), nullable=False),
    sa.Column('testing_criteria', core.db.JSONType, nullable=False),
    sa.Column('owner_id', sa.String(length=40), nullable=True),
    sa.Column('project_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.Column('updated_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['owner_id'], ['user.user_id'], name=op.f('fk_eval_owner_id_user'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['project_id'], ['project.project_id'], name=op.f('fk_eval_project_id_project'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('eval_id', name=op.f('pk_eval'))
    )
    with op.batch_alter_table('eval', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_eval_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_eval_project_id'), ['project_id'], unique=False)

    op.create_table('eval_run',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('eval_id', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('user_metadata', core.db.JSONType, nullable=True),
    sa.Column('model', sa.String(length=512), nullable=False),
    sa.Column('data_source', core.db.JSONType, nullable=False),
    sa.Column('owner_id', sa.String(length=40), nullable=True),
    sa.Column('project_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['eval_id'], ['eval.eval_id'], name=op.f('fk_eval_run_eval_id_eval'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['job.job_id'], name=op.f('fk_eval_run_job_id_job'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['owner_id'], ['user.user_id'], name=op.f('fk_eval_run_owner_id_user'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['project_id'], ['project.project_id'], name=op.f('fk_eval_run_project_id_project'), ondelete='RESTRICT'),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_eval_run'))
    )
    with op.batch_alter_table('eval_run', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_eval_run_eval_id'), ['eval_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_eval_run_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_eval_run_owner_id'), ['owner_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_eval_run_project_id'), ['project_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('eval_run', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_eval_run_project_id'))
        batch_op.drop_index(batch_op.f('ix_eval_run_owner_id'))
        batch_op.drop_index(batch_op.f('ix_eval_run_job_id'))
        batch_op.drop_index(batch_op.f('ix_eval_run_eval_id'))

    op.drop_table('eval_run')
    with op.batch_alter_table('eval', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_eval_project_id'))
        batch_op.drop_index(batch_op.f('ix_eval_owner_id'))

    op.drop_table('eval')
