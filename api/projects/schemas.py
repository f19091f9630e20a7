from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.inputs import INT32_MAX
from core.projects.models import Project

Priority = Literal["low", "normal", "high"]
Role = Literal["member", "admin"]
ServerNames = list[Annotated[str, Field(min_length=1, max_length=64)]]
"""Names of the box's tracking servers (FTQ_TRACKING_SERVERS, and the implicit mlflow and wandb)."""


class ProjectOut(BaseModel):
    id: str
    object: Literal["project"] = "project"
    name: str
    max_gpus: int | None
    """GPUs the project's running jobs may hold at once; null: no project quota."""
    max_priority: Priority | None
    """The highest priority its jobs may ask for; null: any."""
    tracking_servers: list[str] | None
    """The box's tracking servers its jobs may send to; null: all of them, []: none."""
    role: Role | None
    """The caller's role in it (null: a global admin who is not a member)."""
    default: bool
    """Whether the caller's work goes here when a request names no project."""
    created_at: dt.datetime

    @classmethod
    def of(cls, project: Project, *, role: str | None, default: bool) -> ProjectOut:
        return cls(id=project.project_id, name=project.name, max_gpus=project.max_gpus,
                   max_priority=project.max_priority, tracking_servers=project.tracking_servers,
                   role=role, default=default,  # type: ignore[arg-type]
                   created_at=project.created_at)


class ProjectList(BaseModel):
    data: list[ProjectOut]


class ProjectCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    max_gpus: int | None = Field(default=None, ge=0, le=INT32_MAX)
    max_priority: Priority | None = None
    tracking_servers: ServerNames | None = Field(default=None, max_length=64)
    """The box's tracking servers its jobs may send to (null: all of them, []: none)."""


class ProjectPatch(BaseModel):
    """Only the fields sent change; ``null`` removes the quota or the ceiling, or allows all of
    the box's tracking servers again."""

    model_config = ConfigDict(extra="forbid")

    max_gpus: int | None = Field(default=None, ge=0, le=INT32_MAX)
    max_priority: Priority | None = None
    tracking_servers: ServerNames | None = Field(default=None, max_length=64)


class MemberOut(BaseModel):
    object: Literal["project.member"] = "project.member"
    user: str
    role: Role


class MemberList(BaseModel):
    data: list[MemberOut]


class MemberPut(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role = "member"
