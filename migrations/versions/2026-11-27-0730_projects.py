"""projects: ``project`` and ``project_member``; a project on files, jobs and exports.

``user.default_project_id`` is where a user's work goes when a request names no project;
``api_key.project_id`` a key's own default (None: its user's). Every existing user, file, job and
export goes into one project named ``default`` (every user a member and it their default); a
fresh store gets the ``default`` project too, so the first users have a project to join. The
downgrade drops the tables and columns and keeps every row of the work itself; upgrading again
puts it all into ``default`` once more.

SQLite: a foreign-key column needs batch mode, a copy of the table. With ``foreign_keys`` on,
dropping the old copy of ``user`` or ``job`` runs their ``ON DELETE CASCADE`` (every API key,
every job event gone) or fails on a RESTRICT, so both directions switch it off first (a PRAGMA
that works outside a transaction: alembic commits each SQLite migration on its own, so none is
open when this one starts) and run ``PRAGMA foreign_key_check`` once the copies are made.

Revision ID: 5d2e8b7c41a9
Revises: 3c7a9e51f2d0
Create Date: 2026-11-27 07:30:00+00:00
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import core.db

revision: str = '5d2e8b7c41a9'
down_revision: str | Sequence[str] | None = '3c7a9e51f2d0'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WORK_TABLES = ('file', 'job', 'export')


def upgrade() -> None:
    _foreign_keys_off()
    op.create_table('project',
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('max_gpus', sa.Integer(), nullable=True),
    sa.Column('max_priority', sa.String(length=8), nullable=True),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('project_id', name=op.f('pk_project')),
    sa.UniqueConstraint('name', name=op.f('uq_project_name'))
    )
    op.create_table('project_member',
    sa.Column('project_id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('created_at', core.db.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['project.project_id'], name=op.f('fk_project_member_project_id_project'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['user_id'], ['user.user_id'], name=op.f('fk_project_member_user_id_user'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('project_id', 'user_id', name=op.f('pk_project_member'))
    )
    with op.batch_alter_table('project_member', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_project_member_user_id'), ['user_id'], unique=False)
    for table, column in (('user', 'default_project_id'), ('api_key', 'project_id')):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column(column, sa.String(length=40), nullable=True))
            batch_op.create_foreign_key(batch_op.f(f'fk_{table}_{column}_project'), 'project', [column], ['project_id'], ondelete='SET NULL')
    for table in WORK_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('project_id', sa.String(length=40), nullable=True))
            batch_op.create_index(batch_op.f(f'ix_{table}_project_id'), ['project_id'], unique=False)
            batch_op.create_foreign_key(batch_op.f(f'fk_{table}_project_id_project'), 'project', ['project_id'], ['project_id'], ondelete='RESTRICT')
    _everything_into_default()
    _check_foreign_keys()


def downgrade() -> None:
    _foreign_keys_off()
    for table in WORK_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(batch_op.f(f'fk_{table}_project_id_project'), type_='foreignkey')
            batch_op.drop_index(batch_op.f(f'ix_{table}_project_id'))
            batch_op.drop_column('project_id')
    for table, column in (('user', 'default_project_id'), ('api_key', 'project_id')):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(batch_op.f(f'fk_{table}_{column}_project'), type_='foreignkey')
            batch_op.drop_column(column)
    with op.batch_alter_table('project_member', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_project_member_user_id'))
    op.drop_table('project_member')
    op.drop_table('project')
    _check_foreign_keys()


def _everything_into_default() -> None:
    """The ``default`` project; every user a member with it as their default; all work in it."""
    now = core.db.utcnow()
    project_id = f"proj-{uuid.uuid4().hex[:24]}"
    project = sa.table('project', sa.column('project_id'), sa.column('name'), sa.column('created_at', core.db.UTCDateTime()))
    member = sa.table('project_member', sa.column('project_id'), sa.column('user_id'), sa.column('role'),
                      sa.column('created_at', core.db.UTCDateTime()))
    user = sa.table('user', sa.column('user_id'), sa.column('default_project_id'))
    bind = op.get_bind()
    bind.execute(project.insert().values(project_id=project_id, name='default', created_at=now))
    user_ids = bind.execute(sa.select(user.c.user_id)).scalars().all()
    if user_ids:
        bind.execute(member.insert(), [{'project_id': project_id, 'user_id': u, 'role': 'member', 'created_at': now}
                                       for u in user_ids])
    bind.execute(user.update().values(default_project_id=project_id))
    for table in WORK_TABLES:
        bind.execute(sa.table(table, sa.column('project_id')).update().values(project_id=project_id))


def _foreign_keys_off() -> None:
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        return
    bind.exec_driver_sql('PRAGMA foreign_keys=OFF')
    if bind.exec_driver_sql('PRAGMA foreign_keys').scalar():
        raise RuntimeError(
            'SQLite kept foreign_keys on (a transaction was open), so copying the user and job tables would '
            'delete their API keys and events; run this migration on its own: ftq db upgrade'
        )


def _check_foreign_keys() -> None:
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        return
    broken = bind.exec_driver_sql('PRAGMA foreign_key_check').fetchall()
    if broken:
        raise RuntimeError(f'the projects migration left rows whose foreign keys point at nothing: {broken[:5]}')
