"""The ``project`` and ``project_member`` tables: the teams work belongs to.

A project holds files, jobs and exports (``project_id`` on each); its members see its work and
nothing of another project's (``core.users.access``). A member is a ``member`` or a project
``admin`` (who manages the project's members); the box's global admins (``user.is_admin``) see
every project. ``max_gpus`` and ``max_priority`` bound what the project's jobs take at once
(``core.jobs.scheduling``), beside each user's own running-job cap; ``tracking_servers`` narrows
the box's tracking servers to those its jobs may send to (``core.jobs.trackers.allowed_trackers``).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from core.db import Base, JSONType, UTCDateTime, utcnow

ROLES = ("member", "admin")
"""``member``: sees and submits the project's work; ``admin``: also adds and removes members."""
DEFAULT_PROJECT = "default"
"""The project the migration put all earlier work and users in; new users join it unless told otherwise."""


class Project(Base):
    """A team's share of the box: its members, its work, its GPU quota and priority ceiling."""

    __tablename__ = "project"

    project_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    max_gpus: Mapped[int | None] = mapped_column(Integer)
    """GPUs the project's running jobs may hold at once; None: no project quota."""
    max_priority: Mapped[str | None] = mapped_column(String(8))
    """The highest priority its jobs may ask for (``low``, ``normal``, ``high``); None: any."""
    tracking_servers: Mapped[list[str] | None] = mapped_column(JSONType)
    """The names of the box's tracking servers its jobs may send to; None: all of them, []: none."""
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)


class ProjectMember(Base):
    """A user's membership of a project, with a role (``ROLES``)."""

    __tablename__ = "project_member"

    project_id: Mapped[str] = mapped_column(ForeignKey("project.project_id", ondelete="CASCADE"), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("user.user_id", ondelete="CASCADE"), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(16), default="member")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, default=utcnow)
