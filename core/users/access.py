"""Who may act on what. The rules of a shared box, in one place:

- everyone with a key sees everything: all jobs (list, read, metrics, events, checkpoints,
  adapters) and all files' descriptions (with their owner), so the team can tell who is using
  the GPUs and why;
- only a job's owner or an admin cancels it; only a file's owner or an admin deletes it;
- a job may train only on files its submitter owns (an admin on any): a dataset may hold data
  its uploader was trusted with and others were not, and a job's checkpoints and adapter are
  downloadable by everyone, so using someone's file would publish what it taught the model;
- rows made before users existed have no owner: only admins act on them;
- ``/openai/v1`` reads per owner, as OpenAI's API does: each user sees only their own files and
  jobs (events, checkpoints, results files), admins everyone's. Another user's id answers 404
  as an unknown id does, never 403, so it is not even confirmed. The core reads enforce it
  (``get_file``/``get_job`` with ``reader=``, ``readable_by`` for listings), not each route.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, true
from sqlalchemy.orm import InstrumentedAttribute, Session

from core.errors import Forbidden, InvalidInput, NotFound
from core.files.models import File
from core.users.models import User
from core.users.service import Caller, get_user


def owner_name(session: Session, owner_id: str | None) -> str | None:
    if owner_id is None:
        return None
    user = session.get(User, owner_id)
    return user.name if user is not None else None


def readable_by(caller: Caller, owner_id: InstrumentedAttribute[str | None]) -> ColumnElement[bool]:
    """The rows a per-owner listing shows ``caller`` (``owner_id``: the model's owner column):
    all for an admin, else the caller's own; ``Caller.may_act_on`` as SQL."""
    return true() if caller.is_admin else owner_id == caller.user_id


def require_owner(
    session: Session, caller: Caller, owner_id: str | None, *, what: str, action: str, param: str
) -> None:
    """Raise ``Forbidden`` naming the owner unless ``caller`` owns the row or is an admin."""
    if caller.may_act_on(owner_id):
        return
    name = owner_name(session, owner_id)
    whose = f"belongs to {name!r}" if name else "has no owner (it predates users)"
    raise Forbidden(
        f"{what} {whose}; only its owner or an admin may {action} it (you are {caller.name!r})",
        param=param,
    )


def require_usable_files(session: Session, caller: Caller, files: dict[str, str | None]) -> None:
    """Refuse a job that names another user's file (``files``: request field -> file id).

    Unknown or deleted ids pass: job creation reports those with what to upload.
    """
    for param, file_id in files.items():
        if file_id is None:
            continue
        row = session.get(File, file_id)
        if row is None or row.deleted_at is not None or caller.may_act_on(row.owner_id):
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
