"""Who may act on what. The rules of a shared box, in one place:

- work belongs to a project (``core.projects``): a member reads their projects' work, all of it
  (jobs, metrics, events, checkpoints, adapters, exports, files' descriptions with their owner),
  so a team can tell who is using the GPUs and why; a global admin reads every project's. Another
  project's id answers 404 as an unknown id does (``Caller.may_read`` in the core reads
  ``get_file``/``get_job``/``get_export`` with ``reader=``, ``readable_by`` for listings);
- what a user creates goes into the project they name, if they are a member (a global admin: any
  project), else their key's or their own default project (``project_for_create``);
- only a job's owner, an admin of its project or a global admin cancels or exports it; the same
  for deleting a file;
- a job may train only on files its submitter owns (an admin on any): a dataset may hold data
  its uploader was trusted with and others were not, and a job's checkpoints and adapter are
  downloadable by its whole project, so using someone's file would publish what it taught the model;
- rows made before users existed have no owner: only admins act on them;
- ``/openai/v1`` reads per owner within the project ``OpenAI-Project`` selects, as OpenAI's API
  does: each user sees only their own files and jobs (events, checkpoints, results files), admins
  everyone's. Another user's id answers 404 as an unknown id does, never 403, so it is not even
  confirmed (``Caller.per_owner``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, select, true
from sqlalchemy.orm import Session

from core.errors import Forbidden, InvalidInput, NotFound
from core.files.models import File
from core.projects.models import Project
from core.users.models import User
from core.users.service import Caller, get_user


def owner_name(session: Session, owner_id: str | None) -> str | None:
    if owner_id is None:
        return None
    user = session.get(User, owner_id)
    return user.name if user is not None else None


def readable_by(caller: Caller, model: Any) -> ColumnElement[bool]:
    """The rows of ``model`` (a table with ``project_id`` and ``owner_id``) a listing shows
    ``caller``: ``Caller.may_read`` as SQL."""
    if caller.is_admin:
        return model.project_id == caller.project_id if caller.per_owner and caller.project_id else true()
    mine = model.project_id.in_(sorted(caller.project_ids))
    return mine & (model.owner_id == caller.user_id) if caller.per_owner else mine


def shown_jobs(session: Session, caller: Caller, job_ids: set[str]) -> dict[str, tuple[bool, str | None]]:
    """For box-wide views of shared GPUs and the queue: per job, whether ``caller`` may see it
    (its id, name, owner, model) and its project's name, which is shown either way: GPUs are
    shared by scheduling, and who holds one is the box's business, what runs on it the project's."""
    from core.jobs.models import Job

    if not job_ids:
        return {}
    rows = session.execute(select(Job.job_id, Job.project_id, Job.owner_id, Project.name)
                           .outerjoin(Project, Project.project_id == Job.project_id)
                           .where(Job.job_id.in_(sorted(job_ids)))).all()
    shown = {job_id: (caller.may_read(project_id, owner_id), name) for job_id, project_id, owner_id, name in rows}
    # An id no job has (a worker's row naming a job deleted since): nobody's work, shown to admins.
    return {job_id: shown.get(job_id, (caller.is_admin, None)) for job_id in job_ids}


def project_named(session: Session, caller: Caller, name: str, *, param: str = "project") -> str:
    """The id of the project ``name`` (a name or id) that ``caller`` is a member of (a global
    admin: any project); NotFound alike for one that does not exist and one of others."""
    project_id = session.scalar(select(Project.project_id).where((Project.name == name) | (Project.project_id == name)))
    if project_id is None or not (caller.is_admin or project_id in caller.project_ids):
        raise NotFound(f"{param}: no project {name!r} among yours; GET /v1/projects lists the projects you are in",
                       param=param)
    return project_id


def project_for_create(session: Session, caller: Caller, name: str | None, *, param: str = "project") -> str:
    """Where new work goes: the project ``name`` if the caller may use it, else (None) the
    caller's default project (the key's, else the user's)."""
    if name:
        return project_named(session, caller, name, param=param)
    if caller.project_id is None:
        raise Forbidden(f"{param}: you ({caller.name!r}) are a member of no project, so there is nowhere to put "
                        "this; ask an admin to add you to one (`ftq projects add-member PROJECT USER`)", param=param)
    return caller.project_id


def project_filter(session: Session, caller: Caller, name: str | None) -> str | None:
    """The project id ``?project=`` names, or None for no filter."""
    return project_named(session, caller, name) if name else None


def require_owner(
    session: Session, caller: Caller, owner_id: str | None, *, what: str, action: str, param: str,
    project_id: str | None = None,
) -> None:
    """Raise ``Forbidden`` naming the owner unless ``caller`` owns the row, is an admin of its
    project (``project_id``) or a global admin."""
    if caller.may_act_on(owner_id, project_id):
        return
    name = owner_name(session, owner_id)
    whose = f"belongs to {name!r}" if name else "has no owner (it predates users)"
    raise Forbidden(
        f"{what} {whose}; only its owner, an admin of its project or an admin may {action} it "
        f"(you are {caller.name!r})",
        param=param,
    )


def require_usable_files(session: Session, caller: Caller, files: dict[str, str | None]) -> None:
    """Refuse a job that names another user's file (``files``: request field -> file id).

    Unknown or deleted ids pass, as do files of projects the caller cannot read (so nothing of
    theirs is named): job creation reports those as unknown, with what to upload.
    """
    for param, file_id in files.items():
        if file_id is None:
            continue
        row = session.get(File, file_id)
        if row is None or row.deleted_at is not None or caller.may_act_on(row.owner_id):
            continue
        if not caller.may_read(row.project_id, row.owner_id):
            continue
        name = owner_name(session, row.owner_id)
        whose = f"belongs to {name!r}" if name else "has no owner (it predates users)"
        raise Forbidden(
            f"{param}: file {file_id} {whose}; a job may use only files its submitter uploaded (admins "
            "may use any). Upload your own copy with POST /v1/files and use its id",
            param=param,
        )


def owner_filter(session: Session, caller: Caller, owner: str | None) -> str | None:
    """The user id that ``?owner=`` names (a user name, or ``me``); None for no filter."""
    if not owner:
        return None
    if owner == "me":
        return caller.user_id
    try:
        return get_user(session, owner).user_id
    except NotFound:
        raise InvalidInput(
            f"owner: no user {owner!r}; give a user name or 'me' (GET /v1/users/me shows yours)", param="owner"
        ) from None
