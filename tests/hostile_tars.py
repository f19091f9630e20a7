"""Tars a hostile worker sends (issue 23), built in memory: the reader's unit tests and the
worker routes' integration tests share them."""

from __future__ import annotations

import io
import tarfile

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
