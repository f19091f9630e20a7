"""``/v1/users``, ``/v1/keys``, ``/v1/session``: who is on the box, their keys, the dashboard login.

Everyone reads themselves (``GET /v1/users/me``) and manages their own keys; creating users,
listing everyone and changing caps is for admins. A new key is in the response once and
never again: the store keeps only its hash.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status

from api.auth import SESSION_COOKIE, SESSION_MAX_AGE_S, AdminDep, CallerDep
from api.deps import SessionDep
from api.users.schemas import (
    KeyCreate,
    KeyIssued,
    KeyList,
    KeyOut,
    SessionCreate,
    SessionOut,
    UserCreate,
    UserCreated,
    UserList,
    UserOut,
    UserPatch,
)
from core.errors import Forbidden
from core.users import access, service
from core.users.models import User
from core.users.service import Caller

router = APIRouter(tags=["users"])


def _named(session: SessionDep, caller: Caller, name: str, action: str) -> User:
    """The user ``name`` (``me`` is the caller), if the caller may ``action`` for them."""
    name = caller.name if name == "me" else name
    if name != caller.name and not caller.is_admin:
        raise Forbidden(f"only {name!r} or an admin may {action}; you are {caller.name!r}", param="name")
    return service.get_user(session, name)


@router.get("/v1/users/me", summary="The caller")
def get_me(caller: CallerDep, session: SessionDep) -> UserOut:
    return UserOut.of(service.get_user(session, caller.name))


@router.get("/v1/users", summary="All users (admin)")
def list_users(_admin: AdminDep, session: SessionDep) -> UserList:
    return UserList(data=[UserOut.of(u) for u in service.list_users(session)])


@router.post("/v1/users", status_code=status.HTTP_201_CREATED, summary="Create a user and its first key (admin)")
def create_user(body: UserCreate, _admin: AdminDep, session: SessionDep) -> UserCreated:
    """The response holds the new user's key: hand it over, it is not shown again."""
    user, issued = service.create_user_with_key(
        session, body.name, is_admin=body.is_admin, max_running_jobs=body.max_running_jobs,
        project_names=body.projects,
    )
    session.commit()
    return UserCreated(user=UserOut.of(user), api_key=issued.secret, key=KeyOut.of(issued.key, user.name))


@router.patch("/v1/users/{name}", summary="Change a user's running-job cap, admin flag or disabled state (admin)")
def update_user(name: str, body: UserPatch, admin: AdminDep, session: SessionDep) -> UserOut:
    fields = body.model_fields_set
    if name in (admin.name, "me") and (body.disabled or body.is_admin is False):
        raise Forbidden("an admin cannot disable or demote themselves; ask another admin", param="name")
    user = service.update_user(
        session,
        admin.name if name == "me" else name,
        max_running_jobs=body.max_running_jobs,
        clear_max_running="max_running_jobs" in fields and body.max_running_jobs is None,
        is_admin=body.is_admin,
        disabled=body.disabled,
    )
    session.commit()
    return UserOut.of(user)


@router.get("/v1/users/{name}/keys", summary="A user's API keys (prefixes only); yours or, for an admin, anyone's")
def list_keys(name: str, caller: CallerDep, session: SessionDep) -> KeyList:
    user = _named(session, caller, name, "list these keys")
    return KeyList(data=[KeyOut.of(k, user.name) for k in service.list_keys(session, user)])


@router.post(
    "/v1/users/{name}/keys",
    status_code=status.HTTP_201_CREATED,
    summary="Issue a new API key; for yourself or, for an admin, anyone",
)
def issue_key(name: str, caller: CallerDep, session: SessionDep, body: KeyCreate | None = None) -> KeyIssued:
    user = _named(session, caller, name, "get a key for this user")
    issued = service.issue_key(session, user, name=body.name if body else None, project=body.project if body else None)
    session.commit()
    return KeyIssued(api_key=issued.secret, key=KeyOut.of(issued.key, user.name))


@router.delete("/v1/keys/{key_id}", summary="Revoke an API key (by id or prefix); yours or, for an admin, anyone's")
def revoke_key(key_id: str, caller: CallerDep, session: SessionDep) -> KeyOut:
    key = service.find_key(session, key_id)
    owner_name = access.owner_name(session, key.user_id) or "?"
    if key.user_id != caller.user_id and not caller.is_admin:
        raise Forbidden(
            f"API key {key.prefix} belongs to {owner_name!r}; only they or an admin may revoke it",
            param="key_id",
        )
    service.revoke_key(session, key)
    session.commit()
    return KeyOut.of(key, owner_name)


@router.post("/v1/session", summary="Dashboard login: trade an API key for an HttpOnly session cookie")
def login(body: SessionCreate, request: Request, response: Response, session: SessionDep) -> SessionOut:
    """Sets the ``ftq_session`` cookie (HttpOnly, SameSite=Strict, Secure over HTTPS), which
    the API accepts in place of a Bearer key, so EventSource streams and download links work.
    Requests it authenticates that change something must also send ``X-Requested-With``."""
    caller = service.verify_key(session, body.api_key)
    session.commit()
    response.set_cookie(
        SESSION_COOKIE,
        body.api_key.strip(),
        max_age=SESSION_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    response.headers["Cache-Control"] = "no-store"
    return SessionOut(user=UserOut.of(service.get_user(session, caller.name)))


@router.delete("/v1/session", status_code=status.HTTP_204_NO_CONTENT, summary="Dashboard logout: drop the cookie")
def logout(response: Response) -> Response:
    response.status_code = status.HTTP_204_NO_CONTENT
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response

