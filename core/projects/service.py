"""Projects and their members: create, read, change, join, leave; which project a request works in.

Each takes a session; the caller commits. Names follow user names' rule (lowercase, digits,
``.``, ``_``, ``-``). A project another user may not see is answered as an unknown one
(``NotFound``), so a name is never confirmed to someone outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, Forbidden, InvalidInput, NotFound
from core.jobs.trackers import allowed_trackers
from core.names import NAME_PATTERN, NAME_RULE
from core.projects.models import DEFAULT_PROJECT, ROLES, Project, ProjectMember
from core.settings import Settings
from core.users.models import User

PRIORITIES = ("low", "normal", "high")


@dataclass(frozen=True)
class Membership:
    """A user's projects: ``{project_id: role}`` and the one their requests default to."""

    roles: dict[str, str]
    default_project_id: str | None


def check_project_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise InvalidInput(f"name: {name!r} is not a project name; use {NAME_RULE}", param="name")
    return name


def check_quota(max_gpus: int | None, max_priority: str | None) -> None:
    if max_gpus is not None and max_gpus < 0:
        raise InvalidInput(f"max_gpus: must be 0 or more (0 stops the project's jobs from starting), got {max_gpus}; "
                           "omit it for no project quota", param="max_gpus")
    if max_priority is not None and max_priority not in PRIORITIES:
        raise InvalidInput(f"max_priority: {max_priority!r} is not one of {', '.join(PRIORITIES)}",
                           param="max_priority")


def check_tracking_servers(names: Sequence[str] | None, settings: Settings) -> list[str] | None:
    """``names`` as stored (sorted, each once), each one of the box's tracking servers
    (``core.jobs.trackers.allowed_trackers``); None stays None (all of the box's).

    Raises:
        InvalidInput: a name the box does not list, naming ``tracking_servers`` and the box's servers.
    """
    if names is None:
        return None
    box = allowed_trackers(settings)
    unknown = [name for name in names if name not in box]
    if unknown:
        raise InvalidInput(f"tracking_servers: {unknown[0]!r} is not a tracking server of this box; its servers: "
                           f"{', '.join(sorted(box))} (FTQ_TRACKING_SERVERS, and the implicit mlflow and wandb); "
                           "null allows all of them, [] none", param="tracking_servers")
    return sorted(set(names))


def create_project(session: Session, name: str, *, max_gpus: int | None = None, max_priority: str | None = None,
                   tracking_servers: Sequence[str] | None = None, settings: Settings | None = None) -> Project:
    """Record a new project (no members yet: see ``add_member``). ``tracking_servers``: the
    box's tracking servers its jobs may use (None: all), checked against ``settings``.

    Raises:
        InvalidInput: a name that is not a project name, a negative quota, an unknown priority,
            a tracking server the box does not list.
        Conflict: the name is taken.
    """
    check_project_name(name)
    check_quota(max_gpus, max_priority)
    servers = None if tracking_servers is None else check_tracking_servers(tracking_servers, _needed(settings))
    if session.scalar(select(Project.project_id).where(Project.name == name)) is not None:
        raise Conflict(f"name: a project named {name!r} exists; pick another name", param="name")
    project = Project(project_id=new_id("proj"), name=name, max_gpus=max_gpus, max_priority=max_priority,
                      tracking_servers=servers, created_at=utcnow())
    session.add(project)
    try:
        session.flush()
    except IntegrityError:  # made by a concurrent request since the check
        session.rollback()
        raise Conflict(f"name: a project named {name!r} exists; pick another name", param="name") from None
    return project


def ensure_default(session: Session) -> Project:
    """The ``default`` project, made if it is missing (the migration makes it; a store emptied by hand may not have it)."""
    project = session.scalar(select(Project).where(Project.name == DEFAULT_PROJECT))
    return project if project is not None else create_project(session, DEFAULT_PROJECT)


def get_project(session: Session, project_id: str) -> Project:
    """The project ``project_id`` (an id found by ``core.users.access.project_named``)."""
    project = session.get(Project, project_id)
    if project is None:
        raise NotFound(f"no project {project_id!r}; GET /v1/projects lists yours", param="project")
    return project


def find_project(session: Session, name: str) -> Project:
    """The project ``name`` (or id), for admins and the CLI; NotFound otherwise."""
    project = session.scalar(select(Project).where((Project.name == name) | (Project.project_id == name)))
    if project is None:
        raise NotFound(f"project: no project {name!r}; list projects with GET /v1/projects", param="project")
    return project


def update_project(session: Session, project: Project, *, max_gpus: int | None = None, clear_max_gpus: bool = False,
                   max_priority: str | None = None, clear_max_priority: bool = False,
                   tracking_servers: Sequence[str] | None = None, clear_tracking_servers: bool = False,
                   settings: Settings | None = None) -> Project:
    """Change what is given; ``clear_*``: back to None (no quota, no ceiling, all the box's
    tracking servers). ``tracking_servers`` is checked against ``settings``."""
    check_quota(max_gpus, max_priority)
    if tracking_servers is not None:
        project.tracking_servers = check_tracking_servers(tracking_servers, _needed(settings))
    elif clear_tracking_servers:
        project.tracking_servers = None
    if clear_max_gpus or max_gpus is not None:
        project.max_gpus = None if clear_max_gpus else max_gpus
    if clear_max_priority or max_priority is not None:
        project.max_priority = None if clear_max_priority else max_priority
    session.flush()
    return project


def _needed(settings: Settings | None) -> Settings:
    if settings is None:
        raise TypeError("tracking_servers are checked against the box's settings: pass settings=")
    return settings


def list_projects(session: Session, project_ids: frozenset[str] | None = None) -> list[Project]:
    """Every project (``project_ids`` None), or those of ``project_ids``, by name."""
    query = select(Project).order_by(Project.name)
    if project_ids is not None:
        query = query.where(Project.project_id.in_(project_ids))
    return list(session.scalars(query))


def memberships(session: Session, user: User, api_key_project_id: str | None = None) -> Membership:
    """The user's roles per project and their default project: the key's, else the user's,
    each only while the user is still a member, else the first of their projects by name."""
    rows = session.execute(
        select(ProjectMember.project_id, ProjectMember.role, Project.name)
        .join(Project, Project.project_id == ProjectMember.project_id)
        .where(ProjectMember.user_id == user.user_id).order_by(Project.name)
    ).all()
    roles = {project_id: role for project_id, role, _ in rows}
    for candidate in (api_key_project_id, user.default_project_id, *roles):
        if candidate in roles:
            return Membership(roles, candidate)
    return Membership(roles, None)


def add_member(session: Session, project: Project, user: User, role: str = "member") -> ProjectMember:
    """Make ``user`` a member of ``project`` with ``role`` (a member already: their role changes)."""
    if role not in ROLES:
        raise InvalidInput(f"role: {role!r} is not one of {', '.join(ROLES)}", param="role")
    member = session.get(ProjectMember, (project.project_id, user.user_id))
    if member is None:
        member = ProjectMember(project_id=project.project_id, user_id=user.user_id, role=role, created_at=utcnow())
        session.add(member)
    member.role = role
    if user.default_project_id is None:
        user.default_project_id = project.project_id
    session.flush()
    return member


def remove_member(session: Session, project: Project, user: User) -> None:
    """End ``user``'s membership; their work stays in the project. Their default moves to
    another of their projects (or none)."""
    member = session.get(ProjectMember, (project.project_id, user.user_id))
    if member is None:
        raise NotFound(f"user: {user.name!r} is not a member of project {project.name!r}", param="user")
    session.delete(member)
    session.flush()
    if user.default_project_id == project.project_id:
        user.default_project_id = session.scalar(
            select(ProjectMember.project_id).where(ProjectMember.user_id == user.user_id).limit(1))
        session.flush()


def list_members(session: Session, project: Project) -> list[tuple[User, str]]:
    rows = session.execute(
        select(User, ProjectMember.role).join(ProjectMember, ProjectMember.user_id == User.user_id)
        .where(ProjectMember.project_id == project.project_id).order_by(User.name)
    ).all()
    return [(user, role) for user, role in rows]


def set_default(session: Session, user: User, project: Project) -> None:
    if session.get(ProjectMember, (project.project_id, user.user_id)) is None:
        raise Forbidden(f"project: {user.name!r} is not a member of {project.name!r}; add them first", param="project")
    user.default_project_id = project.project_id
    session.flush()


def names_by_id(session: Session, project_ids: set[str | None]) -> dict[str, str]:
    """``{project_id: name}`` for the given ids (one query), for responses that show projects."""
    wanted = {p for p in project_ids if p is not None}
    if not wanted:
        return {}
    return dict(session.execute(select(Project.project_id, Project.name).where(Project.project_id.in_(wanted))).all())
