"""The tars that carry a job's artifacts between a worker and the API, written and unpacked
safely. Used by the API's worker routes (``api.workers.artifacts``) and free for the worker's
client to use for the other direction.

A tar is uncompressed (checkpoints are already dense; compression would cost CPU for nothing)
and holds only regular files and directories, named relative to the artifact: extracting it
into an empty directory D recreates the artifact's contents in D, and a single file is one
member named by its basename.

Unpacking trusts nothing in the tar: ``check_members`` refuses (``UnsafeArchive``) absolute
names, ``..`` parts, links, devices, fifos and over-long names before a byte is written, then
``tarfile``'s own ``data`` filter checks again while extracting into a fresh staging directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tarfile
import time
import uuid
from pathlib import Path, PurePosixPath

from core.errors import ChecksumMismatch, UnsafeArchive

CHUNK = 1024 * 1024
MAX_NAME_BYTES = 4096
"""Longest member name accepted (Linux's PATH_MAX)."""
MAX_PART_BYTES = 255
"""Longest part of a member name accepted (NAME_MAX on the usual filesystems)."""
EARLIEST_MTIME = 315532800
"""1980-01-01: an older member time (a tar written with none is at 1970) is stored as now."""


def _regular_files(src: Path) -> list[tuple[str, Path]]:
    """``(name in the tar, file)`` for every regular file under ``src`` (or ``src`` itself),
    in sorted order; links and other special files are left out."""
    if src.is_file():
        return [(src.name, src)]
    found = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                found.append((path.relative_to(src).as_posix(), path))
    return found


def write_tar(src: Path, out: Path) -> tuple[str, int]:
    """Write the tar of ``src`` (a directory or one file) to ``out``; ``(sha256 hex, bytes)``.

    Members are built by hand rather than with ``TarFile.add``, which would write a second
    name of one inode as a hard link (a member type the receiver refuses).
    """
    digest = hashlib.sha256()
    with out.open("wb") as raw:
        with tarfile.open(fileobj=_HashingWriter(raw, digest), mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for name, path in _regular_files(src):
                stat = path.stat()
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
                with path.open("rb") as fh:
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


def check_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Every member, each a regular file or directory under a relative, ``..``-free name.

    Raises:
        UnsafeArchive: naming the first member that is not.
    """
    members = tar.getmembers()
    for member in members:
        name = member.name
        shown = name[:120] + ("..." if len(name) > 120 else "")
        parts = PurePosixPath(name).parts
        reason = None
        if len(name.encode()) > MAX_NAME_BYTES or any(len(p.encode()) > MAX_PART_BYTES for p in parts):
            reason = "a name longer than the filesystem allows"
        elif name.startswith("/") or "\\" in name or "\x00" in name or (parts and ":" in parts[0]):
            reason = "an absolute name"
        elif ".." in parts:
            reason = "a '..' part"
        elif member.issym() or member.islnk():
            reason = "a link"
        elif member.isdev() or member.isfifo():
            reason = "a device or fifo"
        elif not (member.isfile() or member.isdir()):
            reason = "not a regular file or directory"
        if reason is not None:
            raise UnsafeArchive(f"body: tar member {shown!r} is {reason}; send only files and directories "
                                "named relative to the artifact", param="body")
    return members


def extract_into(tar_path: Path, staging: Path) -> int:
    """Unpack ``tar_path`` into the new directory ``staging``; the number of files.

    Raises:
        UnsafeArchive: the body is not a tar, or a member fails ``check_members`` (or the
            ``data`` filter); ``staging`` is removed.
    """
    staging.mkdir(parents=True)
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            members = check_members(tar)
            for member in members:  # a zip of the artifact (the users' downloads) needs 1980 or later
                member.mtime = member.mtime if member.mtime >= EARLIEST_MTIME else time.time()
            tar.extractall(staging, members=members, filter="data")
    except tarfile.TarError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeArchive(f"body: not a tar this route accepts ({exc}); send an uncompressed tar",
                            param="body") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sum(1 for m in members if m.isfile())


def replace_atomically(staging: Path, target: Path, scratch: Path) -> None:
    """Make ``staging`` be ``target``: one rename, after the old ``target`` (if any) is renamed
    aside into ``scratch``; the old copy is removed last. A reader sees the old artifact or the
    new one, never a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    aside = None
    with (scratch / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two uploads of one artifact (API processes too) take turns
        if target.exists() or target.is_symlink():
            aside = scratch / f"old-{uuid.uuid4().hex}"
            os.replace(target, aside)
        os.replace(staging, target)
    if aside is not None:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
