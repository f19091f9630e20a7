"""Download archives of a job's checkpoints and final adapter.

Archives are written to a temporary file under ``<data_dir>/tmp`` and streamed from there
(removed after the response), so a multi-GB full fine-tune never sits in memory. Files are
at the archive's root: ``unzip adapter.zip -d out`` then ``PeftModel.from_pretrained(base, "out")``.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Literal

from core.errors import NotFound

ArchiveFormat = Literal["zip", "tar.gz"]
MEDIA_TYPES = {"zip": "application/zip", "tar.gz": "application/gzip"}


def build_archive(src: Path, fmt: ArchiveFormat, tmp_dir: Path) -> Path:
    """Pack every file under ``src`` (paths relative to it) into a new temporary archive."""
    if not src.is_dir():
        raise NotFound(f"{src.name}: the files are no longer on disk", param="job_id")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=tmp_dir, suffix="." + fmt)
    os.close(fd)
    out = Path(name)
    # Links are left out: they could point anywhere on the box.
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    try:
        if fmt == "zip":
            with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
                for path in files:
                    zf.write(path, path.relative_to(src).as_posix())
        else:
            with tarfile.open(out, "w:gz") as tf:
                for path in files:
                    tf.add(path, arcname=path.relative_to(src).as_posix(), recursive=False)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out
