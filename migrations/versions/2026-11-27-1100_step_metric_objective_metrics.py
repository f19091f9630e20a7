"""step_metric.metrics: the objectives' step fields in one JSON column instead of one column each.

An objective declares the fields it adds to the step event (``trainer.objectives``); a column per
field would make each new one a migration. ``metrics`` holds those of a row that have a value, by
name. The upgrade moves every row's ``token_accuracy`` (SFT) and ``reward_margin``,
``reward_accuracy``, ``chosen_logp``, ``rejected_logp`` (DPO) into it, leaving out nulls (a row
with none gets NULL), then drops the five columns; the downgrade adds them back and moves the
values out again. The rows are copied in Python, in batches: the same code on PostgreSQL and
SQLite, and no JSON functions of either.

Revision ID: 3c7d9e1f5a20
Revises: 8f3b6a2d9e14
Create Date: 2026-11-27 11:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '3c7d9e1f5a20'
down_revision: str | Sequence[str] | None = '8f3b6a2d9e14'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ('reward_margin', 'reward_accuracy', 'chosen_logp', 'rejected_logp', 'token_accuracy')
"""The step fields that had a column each, as they were at this revision (spelled out: a migration
does not follow the registry)."""
BATCH = 1000


def _table(*columns: sa.Column) -> sa.Table:
    return sa.table('step_metric', sa.column('job_id', sa.String()), sa.column('step', sa.Integer()), *columns)


def upgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.add_column(sa.Column('metrics', core.db.JSONType, nullable=True))
    conn = op.get_bind()
    old = _table(*(sa.column(name, sa.Float()) for name in COLUMNS))
    new = _table(sa.column('metrics', core.db.JSONType))
    rows = conn.execute(sa.select(old).where(sa.or_(*(old.c[name].isnot(None) for name in COLUMNS)))).all()
    updates = [{'k_job': r.job_id, 'k_step': r.step,
                'metrics': {name: getattr(r, name) for name in COLUMNS if getattr(r, name) is not None}} for r in rows]
    _update(conn, new.update().where(new.c.job_id == sa.bindparam('k_job'), new.c.step == sa.bindparam('k_step')),
            updates)
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)


def downgrade() -> None:
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))
    conn = op.get_bind()
    new = _table(sa.column('metrics', core.db.JSONType))
    old = _table(*(sa.column(name, sa.Float()) for name in COLUMNS))
    rows = conn.execute(sa.select(new).where(new.c.metrics.isnot(None))).all()
    updates = [{'k_job': r.job_id, 'k_step': r.step, **{name: (r.metrics or {}).get(name) for name in COLUMNS}}
               for r in rows]
    _update(conn, old.update().where(old.c.job_id == sa.bindparam('k_job'), old.c.step == sa.bindparam('k_step')),
            updates)
    with op.batch_alter_table('step_metric', schema=None) as batch_op:
        batch_op.drop_column('metrics')


def _update(conn: sa.Connection, statement: sa.Update, rows: list[dict]) -> None:
    for i in range(0, len(rows), BATCH):
        conn.execute(statement, rows[i : i + BATCH])
