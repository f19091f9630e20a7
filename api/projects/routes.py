"""``/v1/projects``: the teams work belongs to, their members, quotas and ceilings.

Everyone lists the projects they are in (a global admin: all). A global admin creates projects
and sets their GPU quota, priority ceiling and tracking servers (``core.jobs.trackers``); a project admin (or a global admin) adds and
removes its members and sets their roles. A project the caller is not in answers 404 as an
unknown one, so its name is never confirmed (``core.users.access.project_named``).
"""

from __future__ import annotations

from fastapi import APIRouter, status

from api.auth import AdminDep, CallerDep
from api.deps import SessionDep, SettingsDep
from api.projects.schemas import MemberList, MemberOut, MemberPut, ProjectCreate, ProjectList, ProjectOut, ProjectPatch
from core.errors import Forbidden
from core.projects import service
from core.projects.models import Project
from core.users import access
from core.users.service import Caller, get_user, user_by_id

router = APIRouter(prefix="/v1/projects", tags=["projects"])


def _visible(session: SessionDep, caller: Caller, name: str) -> Project:
    """The project ``name`` if the caller is in it (a global admin: any), else 404."""
    return service.get_project(session, access.project_named(session, caller, name, param="name"))


def _out(caller: Caller, project: Project) -> ProjectOut:
    role = "admin" if project.project_id in caller.admin_of else ("member" if project.project_id in caller.project_ids
                                                                  else None)
    return ProjectOut.of(project, role=role, default=project.project_id == caller.project_id)


def _managed(session: SessionDep, caller: Caller, name: str) -> Project:
    """The project ``name`` if the caller may manage its members: a global or project admin."""
    project = _visible(session, caller, name)
    if not (caller.is_admin or project.project_id in caller.admin_of):
        raise Forbidden(f"only an admin of project {project.name!r} (or a global admin) manages its members; "
                        f"you are a member, {caller.name!r}", param="name")
    return project


@router.get("", summary="The projects you are in (a global admin: all)")
def list_projects(session: SessionDep, caller: CallerDep) -> ProjectList:
    rows = service.list_projects(session, None if caller.is_admin else caller.project_ids)
    return ProjectList(data=[_out(caller, p) for p in rows])


@router.post("", status_code=status.HTTP_201_CREATED, summary="Create a project (global admin)")
def create_project(body: ProjectCreate, admin: AdminDep, session: SessionDep, settings: SettingsDep) -> ProjectOut:
    project = service.create_project(session, body.name, max_gpus=body.max_gpus, max_priority=body.max_priority,
                                     tracking_servers=body.tracking_servers, settings=settings)
    session.commit()
    return _out(admin, project)


@router.get("/{name}", summary="One project you are in")
def get_project(name: str, session: SessionDep, caller: CallerDep) -> ProjectOut:
    return _out(caller, _visible(session, caller, name))


@router.patch("/{name}", summary="Change a project's GPU quota, priority ceiling or tracking servers (global admin)")
def update_project(name: str, body: ProjectPatch, admin: AdminDep, session: SessionDep,
                   settings: SettingsDep) -> ProjectOut:
    fields = body.model_fields_set
    project = service.update_project(
        session, _visible(session, admin, name), max_gpus=body.max_gpus,
        clear_max_gpus="max_gpus" in fields and body.max_gpus is None, max_priority=body.max_priority,
        clear_max_priority="max_priority" in fields and body.max_priority is None,
        tracking_servers=body.tracking_servers,
        clear_tracking_servers="tracking_servers" in fields and body.tracking_servers is None, settings=settings)
    session.commit()
    return _out(admin, project)


@router.get("/{name}/members", summary="A project's members and their roles")
def list_members(name: str, session: SessionDep, caller: CallerDep) -> MemberList:
    project = _visible(session, caller, name)
    return MemberList(data=[MemberOut(user=u.name, role=role) for u, role in service.list_members(session, project)])


@router.put("/{name}/members/{user}", summary="Add a member or change their role (project or global admin)")
def put_member(name: str, user: str, session: SessionDep, caller: CallerDep, body: MemberPut | None = None) -> MemberOut:
    project = _managed(session, caller, name)
    role = body.role if body else "member"
    service.add_member(session, project, get_user(session, user), role)
    session.commit()
    return MemberOut(user=user, role=role)


@router.delete("/{name}/members/{user}", status_code=status.HTTP_204_NO_CONTENT,
               summary="Remove a member; their work stays in the project (project or global admin)")
def remove_member(name: str, user: str, session: SessionDep, caller: CallerDep) -> None:
    project = _managed(session, caller, name)
    service.remove_member(session, project, get_user(session, user))
    session.commit()


@router.put("/{name}/default", summary="Make this project where your work goes when a request names none")
def set_default(name: str, session: SessionDep, caller: CallerDep) -> ProjectOut:
    project = _visible(session, caller, name)
    user = user_by_id(session, caller.user_id)
    service.set_default(session, user, project)
    session.commit()
    return ProjectOut.of(project, role="admin" if project.project_id in caller.admin_of else "member", default=True)
