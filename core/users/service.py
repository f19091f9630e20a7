"""Users and their API keys: create, issue, verify, revoke. Each takes a session; the caller commits.

A user's key reads ``ftq_<prefix>_<secret>``; minting, finding, verifying and revoking it is
``core.keys``' (the same as for worker keys) with the scheme ``USER_KEYS``. Here: what only a
user's key has, its user (who must not be disabled) and its default project.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import keys
from core.db import new_id, utcnow
from core.errors import Conflict, InvalidInput, NotFound, Unauthenticated
from core.keys import hash_key as hash_key  # re-exported: a user key's hash, as the store keeps it
from core.keys import public_key_id
from core.names import NAME_PATTERN, NAME_RULE
from core.projects import service as projects
from core.projects.models import Project
from core.users.models import ApiKey, User

KEY_SCHEME = "ftq"
RESERVED_NAMES = frozenset({"me"})  # ``?owner=me`` means the caller
USER_KEYS = keys.KeyScheme(
    scheme=KEY_SCHEME, model=ApiKey, id_column="api_key_id", id_prefix="key", lookup=("api_key_id", "prefix"),
    malformed="the API key is malformed: keys look like ftq_<8 hex>_<secret>; copy the whole key "
              "(`ftq users key NAME` issues a new one)",
    invalid="the API key is not valid; check that it was copied whole, or ask an admin for a new one",
    revoked="the API key {key.prefix} was revoked at {at}; ask an admin for a new one",
    not_found="no API key {wanted!r}; give a key id (key-…) or its prefix (the 8 characters after ftq_), "
              "see GET /v1/users/me/keys or `ftq users list`",
    not_found_param="key_id",
)


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a snapshot of the user, detached from any session.

    ``project_ids``: the projects whose work the caller reads (their memberships; narrowed to one
    on ``/openai/v1``, where ``OpenAI-Project`` picks it); ``admin_of``: those they are a project
    admin of; ``project_id``: where what they create goes when they name no project (the key's,
    else the user's default); ``per_owner``: the ``/openai/v1`` view, as OpenAI's API has it: reads
    also need the caller to own the row, and listings show ``project_id``'s rows only (an admin's too).
    """

    user_id: str
    name: str
    is_admin: bool
    api_key_id: str | None = None
    project_ids: frozenset[str] = field(default_factory=frozenset)
    admin_of: frozenset[str] = field(default_factory=frozenset)
    project_id: str | None = None
    per_owner: bool = False

    def may_act_on(self, owner_id: str | None, project_id: str | None = None) -> bool:
        """Owners act on their own jobs and files, a project's admins on its work (``project_id``:
        the row's project, where the action allows it), global admins on everyone's (and on
        unowned rows)."""
        return (self.is_admin or (owner_id is not None and owner_id == self.user_id)
                or (project_id is not None and project_id in self.admin_of))

    def may_read(self, project_id: str | None, owner_id: str | None) -> bool:
        """A row of ``project_id`` (owned by ``owner_id``) is the caller's to read: a global admin
        reads every row; anyone else those of their projects (and, ``per_owner``, only their own)."""
        if self.is_admin:
            return True
        if project_id is None or project_id not in self.project_ids:
            return False
        return not self.per_owner or owner_id == self.user_id


@dataclass(frozen=True)
class IssuedKey:
    """A new key: ``secret`` is the whole key, shown once and never stored."""

    key: ApiKey
    secret: str


def split_key(raw: str, *, expected: str = KEY_SCHEME) -> tuple[str, str] | None:
    """``(prefix, secret)`` of a well-formed key of scheme ``expected`` (``ftq``: users' keys,
    ``ftqw``: worker keys), else None."""
    return keys.split_key(raw, expected=expected)


# --- users ------------------------------------------------------------------------------------


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name) or name in RESERVED_NAMES:
        raise InvalidInput(
            f"name: {name!r} is not a user name; use {NAME_RULE} (and not 'me')",
            param="name",
        )
    return name


def check_max_running(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise InvalidInput(
            f"max_running_jobs: must be 0 or more (0 stops the user's jobs from starting), got {value}; "
            "omit it to use FTQ_MAX_RUNNING_JOBS_PER_USER",
            param="max_running_jobs",
        )
    return value


def create_user(
    session: Session, name: str, *, is_admin: bool = False, max_running_jobs: int | None = None,
    project_names: list[str] | None = None,
) -> User:
    """Record a new user (no key yet: see ``issue_key``), a member of ``project_names`` (the
    first their default), or of the ``default`` project when none is named.

    Raises:
        InvalidInput: a name that is not a user name, or a negative cap.
        Conflict: the name is taken.
        NotFound: a project that does not exist.
    """
    check_name(name)
    check_max_running(max_running_jobs)
    joined = [projects.find_project(session, p) for p in project_names] if project_names else [
        projects.ensure_default(session)]
    if session.scalar(select(User).where(User.name == name)) is not None:
        raise Conflict(f"name: a user named {name!r} exists; pick another name, or issue it a new key",
                       param="name")
    user = User(
        user_id=new_id("user"), name=name, is_admin=is_admin, max_running_jobs=max_running_jobs,
        created_at=utcnow(),
    )
    session.add(user)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"name: a user named {name!r} exists; pick another name", param="name") from None
    for project in joined:
        projects.add_member(session, project, user)
    return user


def get_user(session: Session, name: str) -> User:
    user = session.scalar(select(User).where(User.name == name))
    if user is None:
        raise NotFound(f"no user {name!r}; list users with GET /v1/users (or `ftq users list`)", param="name")
    return user


def user_by_id(session: Session, user_id: str) -> User:
    """The user ``user_id`` (a caller's own row, a key's owner).

    Raises:
        NotFound: no such user (deleted since).
    """
    user = session.get(User, user_id)
    if user is None:
        raise NotFound(f"no user {user_id!r}; list users with GET /v1/users (or `ftq users list`)", param="user_id")
    return user


def list_users(session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.name)))


def count_users(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(User)) or 0)


def names_by_id(session: Session, user_ids: set[str | None]) -> dict[str, str]:
    """``{user_id: name}`` for the given ids (one query), for responses that show owners."""
    wanted = {u for u in user_ids if u is not None}
    if not wanted:
        return {}
    rows = session.execute(select(User.user_id, User.name).where(User.user_id.in_(wanted)))
    return {user_id: name for user_id, name in rows}


def update_user(
    session: Session,
    name: str,
    *,
    max_running_jobs: int | None = None,
    clear_max_running: bool = False,
    is_admin: bool | None = None,
    disabled: bool | None = None,
) -> User:
    """Change a user's cap, admin flag or disabled state (a disabled user's keys stop working)."""
    user = get_user(session, name)
    if clear_max_running:
        user.max_running_jobs = None
    elif max_running_jobs is not None:
        user.max_running_jobs = check_max_running(max_running_jobs)
    if is_admin is not None:
        user.is_admin = is_admin
    if disabled is not None:
        user.disabled_at = (user.disabled_at or utcnow()) if disabled else None
    session.flush()
    return user


def caller_of(session: Session, user: User, key: ApiKey | None = None) -> Caller:
    """The caller ``user`` is (through ``key``), with their projects as they stand now."""
    member = projects.memberships(session, user, key.project_id if key is not None else None)
    return Caller(
        user_id=user.user_id, name=user.name, is_admin=user.is_admin,
        api_key_id=key.api_key_id if key is not None else None, project_ids=frozenset(member.roles),
        admin_of=frozenset(p for p, role in member.roles.items() if role == "admin"),
        project_id=member.default_project_id,
    )


# --- keys -------------------------------------------------------------------------------------


def issue_key(session: Session, user: User, *, name: str | None = None, project: str | None = None) -> IssuedKey:
    """Make a new key for ``user`` (its default project ``project``, one of the user's, else the
    user's own default); the returned ``secret`` is the only copy of the whole key.

    Raises:
        NotFound: ``project`` is not one of the user's projects.
    """
    project_id = None
    if project is not None:
        found = session.scalar(select(Project.project_id).where((Project.name == project) | (Project.project_id == project)))
        if found is None or found not in projects.memberships(session, user).roles:  # one answer: no name confirmed
            raise NotFound(f"project: {user.name!r} has no project {project!r}; GET /v1/projects lists theirs",
                           param="project")
        project_id = found
    key, raw = keys.mint(session, USER_KEYS, user_id=user.user_id, name=name, project_id=project_id)
    return IssuedKey(key=key, secret=raw)


def list_keys(session: Session, user: User) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).where(ApiKey.user_id == user.user_id).order_by(ApiKey.created_at)))


def find_key(session: Session, id_or_prefix: str) -> ApiKey:
    """A key by its id (``key-…``) or its prefix (the 8 hex characters after ``ftq_``)."""
    return keys.find(session, USER_KEYS, id_or_prefix)


def revoke_key(session: Session, key: ApiKey) -> ApiKey:
    """Revoke ``key`` (idempotent: revoking a revoked key keeps its first revocation time)."""
    return keys.revoke(session, key)


def verify_key(session: Session, raw: str) -> Caller:
    """The caller a key belongs to; the caller commits (``last_used_at`` may have moved).

    Raises:
        Unauthenticated: a malformed, unknown or revoked key, or a disabled user; the message
            says which and what to do, never anything about other keys.
    """
    key = keys.check(session, USER_KEYS, raw)
    user = session.get(User, key.user_id)
    if user is None or user.disabled_at is not None:
        raise Unauthenticated(
            f"the user of API key {key.prefix} is disabled; ask an admin to enable it", param="Authorization",
            key_id=public_key_id(KEY_SCHEME, key.prefix),
        )
    keys.touch(session, USER_KEYS, key)
    return caller_of(session, user, key)


def create_user_with_key(
    session: Session, name: str, *, is_admin: bool = False, max_running_jobs: int | None = None,
    project_names: list[str] | None = None,
) -> tuple[User, IssuedKey]:
    """``create_user`` then ``issue_key``: what ``ftq users create`` and ``POST /v1/users`` do."""
    user = create_user(session, name, is_admin=is_admin, max_running_jobs=max_running_jobs,
                       project_names=project_names)
    return user, issue_key(session, user, name="initial")
