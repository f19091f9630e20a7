from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel

from core.files.models import File


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    filename: str
    purpose: str
    bytes: int
    sha256: str
    format: str
    """``chat``, ``prompt_completion`` or ``text``."""
    num_records: int
    stats: dict[str, Any]
    owner: str | None
    """The uploader's user name (null for files uploaded before users existed)."""
    project: str | None = None
    """The project it belongs to: jobs of that project may train on it."""
    created_at: dt.datetime

    @classmethod
    def of(cls, row: File, *, owner: str | None = None, project: str | None = None) -> FileOut:
        return cls(
            id=row.file_id,
            filename=row.filename,
            purpose=row.purpose,
            bytes=row.bytes,
            sha256=row.sha256,
            format=row.format,
            num_records=row.num_records,
            stats=row.stats or {},
            owner=owner,
            project=project,
            created_at=row.created_at,
        )


class FileList(BaseModel):
    data: list[FileOut]
    next_cursor: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
