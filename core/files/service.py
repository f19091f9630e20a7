"""Uploaded datasets: receive, validate, store, list, delete.

The same bytes uploaded again by the same owner for the same purpose are not stored twice: the
upload answers with the file already stored (``find_duplicate``). A ShareGPT or Alpaca file is
stored converted to chat ``messages`` (``core.files.convert``; ``stats.converted_from`` says so;
``sha256`` stays that of the bytes uploaded, so the same upload is still found). An upload is streamed into a temporary file under ``<data_dir>/files/.incoming`` while it is
hashed and counted (``FileSink``), then validated whole (``core.files.validate``). Only a
valid file is moved to ``<data_dir>/files/<file_id>.jsonl`` and recorded; on any failure the
temporary file is removed and no row exists, so a refused upload leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Literal

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, InvalidDataset, InvalidInput, NotFound, TooLarge
from core.files.convert import convert_to_chat
from core.files.models import File
from core.files.validate import DatasetSummary, answerless_prompts, validate_dataset, validate_prompts
from core.jobs.models import Job
from core.jobs.states import ACTIVE_STATUSES
from core.paging import page_newest_first, split_page
from core.users.access import readable_by
from core.users.service import Caller

Purpose = Literal["train", "validation", "generate", "evals"]
PURPOSES = ("train", "validation", "generate", "evals")
"""``generate``: a generation job's prompts (``trainer.generate.prompts``: chat or text lines);
``evals``: an eval run's items (``core.evals.items``: ``{"item": {...}}`` lines)."""
UPLOAD_LAYOUTS = ("auto", "sharegpt", "alpaca", "prompts")
"""The upload's ``format``: ``auto`` detects ShareGPT / Alpaca; naming one converts or refuses;
``prompts``: a GRPO job's training file of prompts (``core.files.validate.validate_prompts``)."""


class FileSink:
    """A temporary file that hashes and counts what is written and refuses more than ``max_bytes``.

    Use as a context manager: leaving it without ``keep()`` removes the temporary file.
    """

    def __init__(self, files_dir: Path, max_bytes: int) -> None:
        incoming = files_dir / ".incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=incoming, suffix=".part")
        self.path = Path(name)
        self._fh: IO[bytes] = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept = False

    def write(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self.bytes > self.max_bytes:
            raise TooLarge(
                f"file: larger than the limit of {self.max_bytes} bytes (FTQ_MAX_UPLOAD_BYTES); "
                "split the dataset or raise the limit",
                param="file",
            )
        self._hash.update(chunk)
        self._fh.write(chunk)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def keep(self) -> None:
        self._kept = True

    def __enter__(self) -> FileSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if not self._kept:
            self.path.unlink(missing_ok=True)


def store_upload(
    session: Session,
    sink: FileSink,
    *,
    filename: str,
    purpose: str,
    files_dir: Path,
    owner_id: str | None = None,
    layout: str = "auto",
    project_id: str | None = None,
    or_prompts: bool = False,
) -> File:
    """Validate the received file and record it as ``owner_id``'s in ``project_id``; commits, so
    row and bytes always agree. A file this owner already stored in this project with the same
    sha256 and purpose is returned
    as it is (nothing new is written), once a declared ``layout`` other than ``auto`` is checked
    against its bytes as new bytes would be. ``or_prompts`` (OpenAI's files, where a reinforcement
    file is uploaded with no format): an ``auto`` upload that is no dataset but a prompts file
    whose every record awaits an answer (``answerless_prompts``) is stored as prompts; otherwise
    the dataset's refusal stands.

    Raises:
        InvalidInput: bad ``purpose`` or ``filename``.
        InvalidDataset: the first bad line and why (the temporary file is removed by the sink).
    """
    check_purpose(purpose)
    if layout not in UPLOAD_LAYOUTS:
        raise InvalidInput(f"format: {layout!r} is not one of {', '.join(UPLOAD_LAYOUTS)}", param="format")
    filename = _clean_filename(filename)
    sink.close()
    prompts, or_prompts = purpose == "generate" or layout == "prompts", or_prompts and layout == "auto"
    same = find_duplicate(session, sink.sha256, purpose=purpose, owner_id=owner_id, project_id=project_id)
    if same is not None and ((same.format == "prompts") == prompts or or_prompts):  # the sink removes the copy
        if layout not in ("auto", "prompts", (same.stats or {}).get("converted_from")):
            check_layout(sink.path, layout)
        return same
    source, converted_from, summary = _described(sink.path, purpose, prompts, layout, or_prompts)
    file_id = new_id("file")
    final = files_dir / f"{file_id}.jsonl"
    os.replace(source, final)
    if converted_from is None:
        sink.keep()
    row = File(
        file_id=file_id,
        filename=filename,
        purpose=purpose,
        bytes=final.stat().st_size,
        sha256=sink.sha256,
        format=summary.format,
        num_records=summary.num_records,
        path=str(final),
        stats=summary.stats,
        owner_id=owner_id,
        project_id=project_id,
        created_at=utcnow(),
    )
    return commit_file(session, row)


def _described(path: Path, purpose: str, prompts: bool, layout: str,
               or_prompts: bool) -> tuple[Path, str | None, DatasetSummary]:
    """``(the file to keep, the layout it was converted from or None, its summary)`` by purpose."""
    if purpose == "evals":
        from core.evals.items import summarize_file

        return path, None, DatasetSummary(*summarize_file(path))
    if prompts:
        return path, None, validate_prompts(path)
    return _validated_or_prompts(path, layout, or_prompts)


def _validated_or_prompts(path: Path, layout: str, or_prompts: bool) -> tuple[Path, str | None, DatasetSummary]:
    """``_converted_and_validated``, or, with ``or_prompts``, the prompts file it may be instead."""
    try:
        return _converted_and_validated(path, layout)
    except InvalidDataset:
        if not or_prompts or (summary := answerless_prompts(path)) is None:
            raise
        return path, None, summary


def _converted_and_validated(path: Path, layout: str) -> tuple[Path, str | None, DatasetSummary]:
    """``(the chat file to keep, the layout it was converted from or None, its summary)`` of the
    upload at ``path``; a converted copy is removed again when it does not validate."""
    source, converted_from = path, None
    try:
        converted = convert_to_chat(path, layout=None if layout == "auto" else layout)
        if converted is not None:
            source, converted_from = converted
        summary = validate_dataset(source)
    except InvalidDataset as exc:
        if converted_from is not None:
            source.unlink(missing_ok=True)
        exc.param = exc.param or "file"
        raise
    if converted_from is not None:
        summary.stats["converted_from"] = converted_from
    return source, converted_from, summary


def check_layout(path: Path, layout: str) -> None:
    """Raise what an upload of ``path`` declared as ``layout`` (sharegpt, alpaca) raises: an
    ``InvalidDataset`` naming the first record that is not one. For bytes that deduplicate to a
    file stored under another layout, so the declared format is checked either way."""
    try:
        converted = convert_to_chat(path, layout=layout)
    except InvalidDataset as exc:
        exc.param = exc.param or "file"
        raise
    if converted is not None:
        converted[0].unlink(missing_ok=True)


def commit_file(session: Session, row: File) -> File:
    """Store ``row``, whose bytes are already at ``row.path``; a failed commit removes the bytes."""
    try:
        session.add(row)
        session.commit()
    except BaseException:
        session.rollback()
        Path(row.path).unlink(missing_ok=True)
        raise
    return row


def find_duplicate(session: Session, sha256: str, *, purpose: str, owner_id: str | None,
                   project_id: str | None = None) -> File | None:
    """The caller's live file with these bytes and purpose in this project, if any: uploading the
    same dataset again (every ``ftq submit`` of a job file naming a local path does) returns the
    stored file instead of a second copy. Per owner, so deleting one's file never touches another's,
    and per project, so a job of one project never trains on a file of another."""
    query = select(File).where(File.sha256 == sha256, File.purpose == purpose, File.deleted_at.is_(None),
                               File.owner_id == owner_id if owner_id is not None else File.owner_id.is_(None),
                               File.project_id == project_id if project_id is not None else File.project_id.is_(None))
    return session.scalars(query.order_by(File.created_at).limit(1)).first()


def check_purpose(purpose: str) -> None:
    if purpose not in PURPOSES:
        raise InvalidInput(f"purpose: {purpose!r} is not one of {', '.join(PURPOSES)}", param="purpose")


def find_file(session: Session, file_id: str) -> File | None:
    """The row of ``file_id``, deleted or not (a finished job still names its files); None if unknown."""
    return session.get(File, file_id)


def get_file(session: Session, file_id: str, *, reader: Caller | None = None) -> File:
    """The live file ``file_id``.

    ``reader``: the caller (``core.users.access``): a file of a project they are not in (on
    ``/openai/v1``, also another user's) is NotFound exactly as an unknown id is, so its id is
    never confirmed. None: the system's own read (worker, job creation), every file.
    """
    row = session.get(File, file_id)
    if row is None or row.deleted_at is not None or (reader is not None and not reader.may_read(row.project_id, row.owner_id)):
        raise NotFound(f"no file {file_id!r}; list uploaded files with GET /v1/files", param="file_id")
    return row


def list_files(
    session: Session,
    *,
    purpose: str | None = None,
    owner_id: str | None = None,
    limit: int = 50,
    after: str | None = None,
    reader: Caller | None = None,
    project_id: str | None = None,
) -> tuple[list[File], str | None]:
    """Live files newest first: those ``reader`` may read (None: all), of ``owner_id`` and
    ``project_id`` when given."""
    query = select(File).where(File.deleted_at.is_(None))
    if reader is not None:
        query = query.where(readable_by(reader, File))
    if project_id is not None:
        query = query.where(File.project_id == project_id)
    if owner_id is not None:
        query = query.where(File.owner_id == owner_id)
    if purpose is not None:
        check_purpose(purpose)
        query = query.where(File.purpose == purpose)
    query = page_newest_first(query, File.created_at, File.file_id, limit=limit, after=after)
    rows = list(session.scalars(query))
    return split_page(rows, limit, "created_at", "file_id")


def delete_file(session: Session, file_id: str, *, reader: Caller | None = None) -> File:
    """Remove a file's bytes and hide it; refused while a queued or running job uses it.

    The row stays (marked deleted) because finished jobs still name it. Commits, then removes
    the bytes, so a failed commit never leaves a row pointing at nothing.
    """
    row = get_file(session, file_id, reader=reader)
    in_use = session.scalar(
        select(
            exists().where(
                (Job.training_file_id == file_id) | (Job.validation_file_id == file_id),
                Job.status.in_([s.value for s in ACTIVE_STATUSES]),
            )
        )
    )
    if in_use:
        raise Conflict(
            f"file {file_id} is used by a queued or running job; cancel the job or wait for it to finish",
            param="file_id",
        )
    row.deleted_at = utcnow()
    session.commit()
    Path(row.path).unlink(missing_ok=True)
    return row


def paths_for(session: Session, file_ids: Iterable[str | None]) -> dict[str, str]:
    """file id -> stored path for the given ids (for ``core.jobs.translate.to_train_config``)."""
    ids = [i for i in file_ids if i]
    rows = session.scalars(select(File).where(File.file_id.in_(ids))).all()
    return {row.file_id: row.path for row in rows}


def _clean_filename(filename: str) -> str:
    name = Path(filename.replace("\\", "/")).name.strip()
    if not name:
        raise InvalidInput("file: the upload has no filename; send it as a named multipart file", param="file")
    return name[:255]
