"""Every tar ftq writes, and every tar it unpacks: one writer and one reader with one set of rules.

The writer (``write_tar``) packs the tars that carry a job's artifacts between a worker and the
API (the API's worker routes, ``api.workers.artifacts``, and the worker's client,
``worker.transfer``) and the ``.tar.gz`` downloads of the API (``api.jobs.artifacts``, whose zip
downloads list their files with the same ``tree_members``). The reader (``extract_into``) unpacks
every tar either side receives.

A tar holds only regular files, named relative to the artifact (``tree_members``): extracting it
into an empty directory D recreates the artifact's files in D, and a single file is one member
named by its basename. Links are left out, never followed (a symbolic link could point anywhere
on the box), as are devices and fifos; a second name of one inode (a hard link) is written as a
file of its own, since the reader refuses links; a directory is implied by its files' names (an
empty one is not carried). Each member is mode 0644 with its file's time and no owner's name.
Worker tars are uncompressed (checkpoints are already dense; compression would cost CPU for
nothing); the API's downloads may be gzipped.

Unpacking trusts nothing in the tar. ``read_members`` reads the headers alone, one at a time,
and refuses (``UnsafeArchive``) absolute names, ``..`` parts, links (symbolic and hard),
devices, fifos, sparse files (a 10 KB GNU sparse member unpacks to 3 GiB), over-long names and
sizes the tar cannot hold, and (``TooLarge``) more members or bytes than the caller's
``Limits``, before a byte is written. ``extract_into`` then writes each file itself into a
fresh staging directory, created exclusively, its bytes counted against the limit as written.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from core.errors import ChecksumMismatch, TooLarge, UnsafeArchive

CHUNK = 1024 * 1024
MAX_NAME_BYTES = 4096
"""Longest member name accepted (Linux's PATH_MAX)."""
MAX_PART_BYTES = 255
"""Longest part of a member name accepted (NAME_MAX on the usual filesystems)."""
EARLIEST_MTIME = 315532800
"""1980-01-01: an older member time (a tar written with none is at 1970) is stored as now."""
MAX_MEMBERS = 10_000
"""Members one tar may hold unless the caller says otherwise (the API: FTQ_WORKER_UPLOAD_MAX_MEMBERS).
A checkpoint is a handful of files; an FSDP checkpoint one file per rank and a few more."""


Member = tuple[str, Path | bytes]
"""A file of a tar: its name in the tar, and the file to copy or the bytes to write."""


def tree_members(src: Path) -> list[Member]:
    """``(name in the tar, file)`` for every regular file under ``src`` (or ``src`` itself, named
    by its basename), in sorted order; links and other special files under it are left out."""
    if src.is_file():
        return [(src.name, src)]
    found: list[Member] = []
    for root, _dirs, files in os.walk(src):
        for name in files:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                found.append((path.relative_to(src).as_posix(), path))
    return sorted(found, key=lambda member: PurePosixPath(member[0]).parts)


def write_tar(src: Path | list[Member], out: Path, *, gzip: bool = False) -> tuple[str, int]:
    """Write the tar of ``src`` (a directory or one file, as ``tree_members`` lists it; or the
    members themselves) to ``out``, gzipped if asked; ``(sha256 hex of out, bytes)``.

    Members are built by hand rather than with ``TarFile.add``, which would write a second
    name of one inode as a hard link (a member type the reader refuses) and the owner's names.
    """
    members = tree_members(src) if isinstance(src, Path) else src
    digest = hashlib.sha256()
    with out.open("wb") as raw:
        mode = "w|gz" if gzip else "w|"
        with tarfile.open(fileobj=_HashingWriter(raw, digest), mode=mode, format=tarfile.PAX_FORMAT) as tar:
            for name, item in members:
                info = tarfile.TarInfo(name)
                info.mode = 0o644
                if isinstance(item, bytes):
                    info.size, info.mtime = len(item), int(time.time())
                    tar.addfile(info, io.BytesIO(item))
                    continue
                with item.open("rb") as fh:
                    stat = os.fstat(fh.fileno())
                    info.size, info.mtime = stat.st_size, int(stat.st_mtime)
                    tar.addfile(info, fh)
    return digest.hexdigest(), out.stat().st_size


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, raw, digest) -> None:  # noqa: ANN001 - a binary file and a hashlib object
        self.raw, self.digest = raw, digest

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.raw.write(data)


def check_sha256_header(value: str | None) -> str:
    """The lowercase hex digest a request announced, else ValueError saying what to send."""
    text = (value or "").strip().lower()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(
            "X-Ftq-Sha256: send the sha256 of the request body as 64 hex characters"
            + ("" if value else " (the header is missing)")
        )
    return text


def verify_received(path: Path, *, sha256: str, got_sha256: str, expected_bytes: int | None) -> int:
    """Check what was received into ``path`` against what the sender announced; its size.

    Raises:
        ChecksumMismatch: the size differs from ``expected_bytes`` or the hash from ``sha256``.
    """
    size = path.stat().st_size
    if expected_bytes is not None and size != expected_bytes:
        raise ChecksumMismatch(
            f"body: received {size} bytes of the {expected_bytes} announced (a truncated transfer); send it again",
            param="body",
        )
    if got_sha256 != sha256:
        raise ChecksumMismatch(
            f"body: its sha256 is {got_sha256}, not the {sha256} announced in X-Ftq-Sha256 "
            "(corrupted on the way); send it again",
            param="X-Ftq-Sha256",
        )
    return size


@dataclass(frozen=True)
class Limits:
    """What one tar may hold; ``extract_into`` refuses a tar past them before writing a byte."""

    max_members: int = MAX_MEMBERS
    """Members (files and directories) a tar may hold."""
    max_bytes: int | None = None
    """Bytes its files may unpack to; None: no bound."""
    members_hint: str = "pack fewer files"
    """What to do about a tar with too many members (the setting that bounds them)."""
    bytes_hint: str = ""
    """What ``max_bytes`` is (a quota, its setting) and what to do, said when a tar passes it."""


def _unsafe(member: tarfile.TarInfo, archive_bytes: int) -> str | None:
    """Why ``member`` may not be unpacked, or None."""
    name = member.name
    parts = PurePosixPath(name).parts
    if not parts:
        return None if member.isdir() else "an empty name"  # ``./``, as ``tar -C dir .`` writes it
    if len(name.encode()) > MAX_NAME_BYTES or any(len(p.encode()) > MAX_PART_BYTES for p in parts):
        return "a name longer than the filesystem allows"
    if name.startswith("/") or "\\" in name or "\x00" in name or ":" in parts[0]:
        return "an absolute name"
    if ".." in parts:
        return "a '..' part"
    if member.issym() or member.islnk():
        return "a link"
    if member.isdev() or member.isfifo():
        return "a device or fifo"
    if member.sparse is not None or member.type == tarfile.GNUTYPE_SPARSE or any(
        key.startswith("GNU.sparse.") for key in member.pax_headers
    ):
        return "a sparse file (it would unpack to more bytes than the tar holds)"
    if not (member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.isdir()):
        return "not a regular file or directory"
    if member.isfile() and member.offset_data + member.size > archive_bytes:
        return f"{member.size} bytes long, more than the tar holds after it (a truncated or forged header)"
    return None


def read_members(tar: tarfile.TarFile, archive_bytes: int, limits: Limits) -> list[tarfile.TarInfo]:
    """Every member's header (no data is read), each a regular file or directory under a
    relative, ``..``-free name, at most ``limits.max_members`` of them, files of at most
    ``limits.max_bytes`` in all. Headers are read one at a time, so a tar of a million members
    is refused at the first one past the limit.

    Raises:
        UnsafeArchive: naming the first member that is not safe to unpack.
        TooLarge: more members, or more bytes, than ``limits`` allows.
    """
    members: list[tarfile.TarInfo] = []
    total = 0
    for member in tar:
        if len(members) == limits.max_members:
            raise TooLarge(f"body: the tar holds more than {limits.max_members:,} members; {limits.members_hint}",
                           param="body")
        if (reason := _unsafe(member, archive_bytes)) is not None:
            shown = member.name[:120] + ("..." if len(member.name) > 120 else "")
            raise UnsafeArchive(f"body: tar member {shown!r} is {reason}; send only files and directories "
                                "named relative to the artifact", param="body")
        total += member.size if member.isfile() else 0
        members.append(member)
    if limits.max_bytes is not None and total > limits.max_bytes:
        raise _over_bytes(limits)
    return members


def _over_bytes(limits: Limits) -> TooLarge:
    return TooLarge(f"body: the tar unpacks to more than {limits.max_bytes:,} bytes; {limits.bytes_hint}",
                    param="body")


def extract_into(tar_path: Path, staging: Path, limits: Limits | None = None) -> int:
    """Unpack ``tar_path`` into the new directory ``staging``; the number of files.

    The one reader of every tar that reaches the API from a worker (and of the worker's
    downloads): the headers are checked first (``read_members``), then each file is written
    here, never through ``tarfile``'s extraction: created exclusively (a name twice, or a file
    where a directory was, is refused), no link followed, its bytes counted against
    ``limits.max_bytes`` as they are written.

    Raises:
        UnsafeArchive: the body is not a tar, or a member is unsafe or clashes with another.
        TooLarge: the tar passes ``limits``.
        In each case ``staging`` is removed.
    """
    limits = limits or Limits()
    staging.mkdir(parents=True)
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            members = read_members(tar, tar_path.stat().st_size, limits)
            written = 0
            for member in members:
                written = _unpack(tar, member, staging, written, limits)
    except tarfile.TarError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeArchive(f"body: not a tar this route accepts ({exc}); send an uncompressed tar",
                            param="body") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sum(1 for m in members if m.isfile())


def _unpack(tar: tarfile.TarFile, member: tarfile.TarInfo, staging: Path, written: int, limits: Limits) -> int:
    """Write one checked member under ``staging``; the bytes written so far, this member's included."""
    target = staging.joinpath(*PurePosixPath(member.name).parts)
    try:
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            return written
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        raise UnsafeArchive(f"body: tar member {member.name[:120]!r} clashes with an earlier member (a name given "
                            "twice, or both a file and a directory); send each file once", param="body") from None
    source = tar.extractfile(member)
    assert source is not None, f"member {member.name!r} is a regular file without data"
    with source, os.fdopen(fd, "wb") as sink:
        while chunk := source.read(CHUNK):
            written += len(chunk)
            if limits.max_bytes is not None and written > limits.max_bytes:
                raise _over_bytes(limits)
            sink.write(chunk)
    mtime = member.mtime if member.mtime >= EARLIEST_MTIME else time.time()  # a zip download needs 1980 or later
    os.utime(target, (mtime, mtime))
    return written


def replace_atomically(staging: Path, target: Path, scratch: Path) -> None:
    """Make ``staging`` be ``target``: one rename, after the old ``target`` (if any) is renamed
    aside into ``scratch``; the old copy is removed last. A reader sees the old artifact or the
    new one, never a half-written one. The caller holds the job's store lock
    (``core.jobs.artifact_store.job_lock``), so two uploads of one artifact take turns."""
    target.parent.mkdir(parents=True, exist_ok=True)
    aside = None
    if target.exists() or target.is_symlink():
        aside = scratch / f"old-{uuid.uuid4().hex}"
        os.replace(target, aside)
    os.replace(staging, target)
    if aside is not None:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
