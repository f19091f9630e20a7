"""worker.shared_id, worker.shared_dir: the shared checkpoint directory a machine mounts (issue 29).

Full fine-tuning may span machines that share one checkpoint directory.

``shared_dir`` is ``FTQ_SHARED_DIR`` (the mount's path on that machine), ``shared_id`` the
random id written in the mount's marker file (worker/shared_storage.py): two workers with the
same pair see the same directory at the same path. Both None for a worker without one.
Only columns are added, so SQLite's batch mode alters the table in place (no copy of ``worker``,
whose ``gpu_slot`` rows cascade).

Revision ID: 5e8c1a7d3b92
Revises: 5d3f8a2c6b17
Create Date: 2026-11-28 02:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '5e8c1a7d3b92'
down_revision: str | Sequence[str] | None = '5d3f8a2c6b17'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('worker', schema=None) as batch_op:
        batch_op.add_column(sa.Column('shared_id', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('shared_dir', sa.String(length=1024), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35), not batch mode, which would copy ``worker``
    # and drop the old one: its ``gpu_slot`` rows would cascade
    op.drop_column('worker', 'shared_dir')
    op.drop_column('worker', 'shared_id')
