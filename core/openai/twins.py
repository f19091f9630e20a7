"""A validation file for a job, from a file uploaded with OpenAI's one purpose.

OpenAI has one purpose, ``fine-tune``, for training and validation files alike; ftq keeps
``train`` and ``validation`` apart and a job validates only on a ``validation`` file. So when an
OpenAI upload (stored as ``train``) is named as ``validation_file``, the job validates on its
twin: a ``validation`` file row of the same owner and project over a hard link to the same bytes (a copy
where the file system cannot link), made once and reused by later jobs. The OpenAI view keeps
showing the id the caller named, and ``files.list`` leaves twins out (``list_files``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sqlalchemy import ColumnElement, and_, exists, select
from sqlalchemy.orm import aliased
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.files.models import File
from core.files.service import commit_file
from core.openai.paging import newest_first
from core.users.access import readable_by
from core.users.service import Caller


def validation_twin(session: Session, named: File, files_dir: Path) -> File:
    """``named`` itself when it is a validation file, else its validation twin (committed)."""
    if named.purpose == "validation":
        return named
    existing = session.scalar(
        select(File).where(
            File.purpose == "validation", File.sha256 == named.sha256, File.deleted_at.is_(None),
            File.owner_id.is_(None) if named.owner_id is None else File.owner_id == named.owner_id,
            File.project_id.is_not_distinct_from(named.project_id),
        ).limit(1)
    )
    if existing is not None:
        return existing
    file_id = new_id("file")
    path = files_dir / f"{file_id}.jsonl"
    try:
        os.link(named.path, path)
    except OSError:
        shutil.copyfile(named.path, path)
    twin = File(
        file_id=file_id, owner_id=named.owner_id, project_id=named.project_id, filename=named.filename,
        purpose="validation",
        bytes=named.bytes, sha256=named.sha256, format=named.format, num_records=named.num_records,
        path=str(path), stats=named.stats, created_at=utcnow(),
    )
    return commit_file(session, twin)


def is_validation_twin() -> ColumnElement[bool]:
    """A ``File`` row that is the validation twin of a live training file of the same owner."""
    train = aliased(File)
    return and_(
        File.purpose == "validation",
        exists().where(
            train.purpose == "train", train.sha256 == File.sha256, train.deleted_at.is_(None),
            train.owner_id.is_not_distinct_from(File.owner_id), train.project_id.is_not_distinct_from(File.project_id),
        ),
    )


def list_files(session: Session, caller: Caller, *, after: str | None, limit: int) -> tuple[list[File], bool]:
    """The caller's live files newest first, twins left out (``core.openai.paging``), and whether
    more follow."""
    query = select(File).where(File.deleted_at.is_(None), ~is_validation_twin())
    return newest_first(session, query, File, File.file_id, after=after, limit=limit, what="file",
                        scope=readable_by(caller, File))
