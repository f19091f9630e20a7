"""Tars a hostile worker (or API) sends (issue 23), built in memory. ``HOSTILE`` lists every case
the one reader (``core.workers.archive.extract_into``) must refuse; each path that reads a tar
runs all of them: the reader itself (tests/unit/core/test_worker_archive.py), the worker's
downloads (tests/unit/worker/test_worker_transfer.py) and the API's upload route
(tests/integration/test_api_worker_uploads_bounded.py)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass

GIB = 1 << 30


def _checksummed(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)  # as tarfile writes it: six octal digits, NUL, the space kept
    return bytes(header)


def gnu_sparse_tar(real_size: int = 3 * GIB, name: str = "big") -> bytes:
    """A GNU tar of one sparse member: 4 KiB of data in the tar (10 KiB in all) that a sparse-aware
    reader unpacks to ``real_size`` bytes. tarfile cannot write sparse members, so the header is
    crafted: type ``S``, a map (4096 bytes at 0, then the end) and ``realsize`` at its GNU offsets."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime = 4096, 1_700_000_000
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[386:398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)  # sparse[0].offset
    header[398:410] = tarfile.itn(4096, 12, tarfile.GNU_FORMAT)  # sparse[0].numbytes
    header[410:422] = tarfile.itn(real_size, 12, tarfile.GNU_FORMAT)  # sparse[1]: the end, as GNU tar marks it
    header[422:434] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)
    header[483:495] = tarfile.itn(real_size, 12, tarfile.GNU_FORMAT)  # realsize
    body = _checksummed(header) + b"x" * 4096 + b"\0" * 1024
    return body + b"\0" * (-len(body) % tarfile.RECORDSIZE)


def pax_sparse_tar(real_size: int = 3 * GIB, name: str = "big") -> bytes:
    """The same as GNU tar 1.34 writes it with ``--format=posix`` (sparse format 1.0): a regular
    member whose pax header says ``GNU.sparse.realsize``, its map at the start of the data."""
    info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
    sparse_map = f"2\n0\n4096\n{real_size}\n0\n".encode().ljust(512, b"\0")
    info.size, info.mtime = len(sparse_map) + 4096, 1_700_000_000
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                        "GNU.sparse.realsize": str(real_size)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(sparse_map + b"x" * 4096))
    return buf.getvalue()


def many_members_tar(count: int) -> bytes:
    """``count`` empty files, ``f000000`` on: one header made by tarfile, the others by changing
    its name's digits and its checksum by as much (tarfile takes seconds for 60,000)."""
    info = tarfile.TarInfo("f000000")
    info.mtime = 1_700_000_000
    template = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    base = int(template[148:154], 8) - sum(b"000000")
    parts = []
    for i in range(count):
        digits = b"%06d" % i
        template[1:7] = digits
        template[148:154] = b"%06o" % (base + sum(digits))
        parts.append(bytes(template))
    body = b"".join(parts) + b"\0" * 1024
    return body + b"\0" * (-len(body) % tarfile.RECORDSIZE)


def files_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def forged_size_tar() -> bytes:
    """A member whose pax header claims 3 GiB (read back as its size) with 1 byte after it."""
    info = member("forged")
    info.pax_headers = {"size": str(3 * GIB)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


@dataclass(frozen=True)
class Hostile:
    id: str
    build: Callable[[], bytes]
    says: str
    """What the refusal's message says."""
    too_large: bool = False
    """Refused as past a bound (``TooLarge``, HTTP 413) rather than unsafe (``UnsafeArchive``, 422)."""


HOSTILE = (
    Hostile("absolute", lambda: tar_bytes((member("/etc/evil"), b"x")), "an absolute name"),
    Hostile("dotdot", lambda: tar_bytes((member("../evil"), b"x")), "a '..' part"),
    Hostile("inner-dotdot", lambda: tar_bytes((member("a/../../evil"), b"x")), "a '..' part"),
    Hostile("symlink-absolute", lambda: tar_bytes((member("ok", tarfile.SYMTYPE, "/etc/passwd"), None)), "a link"),
    Hostile("symlink-relative", lambda: tar_bytes((member("rel", tarfile.SYMTYPE, "x"), None)), "a link"),
    Hostile("hardlink", lambda: tar_bytes((member("x"), b"x"), (member("hard", tarfile.LNKTYPE, "x"), None)), "a link"),
    Hostile("chardev", lambda: tar_bytes((member("dev", tarfile.CHRTYPE), None)), "a device or fifo"),
    Hostile("blockdev", lambda: tar_bytes((member("blk", tarfile.BLKTYPE), None)), "a device or fifo"),
    Hostile("fifo", lambda: tar_bytes((member("pipe", tarfile.FIFOTYPE), None)), "a device or fifo"),
    Hostile("long-part", lambda: tar_bytes((member("a" * 300), b"x")), "longer than the filesystem allows"),
    Hostile("long-name", lambda: tar_bytes((member("/".join(["d" * 200] * 30)), b"x")),
            "longer than the filesystem allows"),
    Hostile("not-a-tar", lambda: b"not a tar at all" * 100, "not a tar"),
    Hostile("gnu-sparse", lambda: gnu_sparse_tar(3 * GIB), "a sparse file"),
    Hostile("pax-sparse", lambda: pax_sparse_tar(3 * GIB), "a sparse file"),
    Hostile("forged-size", forged_size_tar, "more than the tar holds"),
    Hostile("same-name-twice", lambda: tar_bytes((member("a"), b"1"), (member("a"), b"2")),
            "clashes with an earlier member"),
    Hostile("file-then-child", lambda: tar_bytes((member("a"), b"1"), (member("a/b"), b"2")),
            "clashes with an earlier member"),
    Hostile("dir-then-file", lambda: tar_bytes((member("d", tarfile.DIRTYPE), None), (member("d"), b"2")),
            "clashes with an earlier member"),
    Hostile("60000-members", lambda: many_members_tar(60_000), "more than 10,000 members", too_large=True),
)
"""Every hostile tar, each refused before a byte of it lands (ids name them in test reports)."""
