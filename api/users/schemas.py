from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.inputs import INT32_MAX
from core.users.models import ApiKey, User


class UserOut(BaseModel):
    id: str
    object: Literal["user"] = "user"
    name: str
    is_admin: bool
    max_running_jobs: int | None
    """Cap on this user's concurrently running jobs; null uses FTQ_MAX_RUNNING_JOBS_PER_USER."""
    disabled: bool
    created_at: dt.datetime

    @classmethod
    def of(cls, user: User) -> UserOut:
        return cls(
            id=user.user_id,
            name=user.name,
            is_admin=user.is_admin,
            max_running_jobs=user.max_running_jobs,
            disabled=user.disabled_at is not None,
            created_at=user.created_at,
        )


class UserList(BaseModel):
    data: list[UserOut]


class KeyOut(BaseModel):
    """An API key as it is stored: never the key itself, only its prefix."""

    id: str
    object: Literal["api_key"] = "api_key"
    prefix: str
    """The 8 hex characters after ``ftq_``: enough to recognise a key, not to use it."""
    user: str
    name: str | None
    created_at: dt.datetime
    last_used_at: dt.datetime | None
    """Updated at most once a minute."""
    revoked_at: dt.datetime | None
    project_id: str | None = None
    """The key's default project (``/openai/v1`` works there without an ``OpenAI-Project``
    header; native creates go there); null: its user's default project."""

    @classmethod
    def of(cls, key: ApiKey, user_name: str) -> KeyOut:
        return cls(
            id=key.api_key_id,
            prefix=key.prefix,
            user=user_name,
            name=key.name,
            created_at=key.created_at,
            last_used_at=key.last_used_at,
            revoked_at=key.revoked_at,
            project_id=key.project_id,
        )


class KeyList(BaseModel):
    data: list[KeyOut]


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    is_admin: bool = False
    max_running_jobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    projects: list[str] | None = Field(default=None, min_length=1, max_length=100)
    """Projects (names) the user joins as a member, the first their default; omitted: ``default``."""


class UserPatch(BaseModel):
    """Only the fields sent change; ``max_running_jobs: null`` goes back to the box default."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    is_admin: bool | None = None
    disabled: bool | None = None
    """A disabled user's keys get 401 until enabled again; their jobs and files stay."""


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=100)
    """A label for the key (e.g. the laptop it lives on)."""
    project: str | None = Field(default=None, min_length=1, max_length=64)
    """The key's default project (a name or id; one of the user's projects), as an OpenAI project key."""


class KeyIssued(BaseModel):
    api_key: str
    """The whole key. Shown this once: the store keeps only its hash."""
    key: KeyOut


class UserCreated(BaseModel):
    user: UserOut
    api_key: str
    """The user's first key. Shown this once: the store keeps only its hash."""
    key: KeyOut


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key: str = Field(min_length=1, max_length=200)


class SessionOut(BaseModel):
    object: Literal["session"] = "session"
    user: UserOut
