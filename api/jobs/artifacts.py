"""Download archives of a job's checkpoints, final adapter and exports.

Archives are written to a temporary file under ``<data_dir>/tmp`` and streamed from there
(removed however the response ends: ``api.responses.TemporaryFileResponse``), so a multi-GB full fine-tune never sits in memory. Files are
at the archive's root: ``unzip adapter.zip -d out`` then ``PeftModel.from_pretrained(base, "out")``.

The final adapter's archive is self-describing (``adapter_members``, ``api.jobs.card``): its
``adapter_config.json`` names the base portably, a ``README.md`` model card says what was
trained and how, and the base's tokenizer files (chat template included) come along.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Literal

from api.jobs.card import TOKENIZER_FILES, AdapterCard
from core.errors import NotFound
from core.workers.archive import Member, tree_members, write_tar

ArchiveFormat = Literal["zip", "tar.gz"]
MEDIA_TYPES = {"zip": "application/zip", "tar.gz": "application/gzip"}


def build_archive(src: Path, fmt: ArchiveFormat, tmp_dir: Path, members: list[Member] | None = None) -> Path:
    """Pack every file under ``src`` (paths relative to it) into a new temporary archive;
    ``members`` (``adapter_members``) replaces that list when given. Links are left out, as from
    every archive ftq writes (``core.workers.archive.tree_members``): they could point anywhere on the box."""
    if not src.is_dir():
        raise NotFound(f"{src.name}: the files are no longer on disk", param="job_id")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=tmp_dir, suffix="." + fmt)
    os.close(fd)
    out = Path(name)
    members = tree_members(src) if members is None else members
    try:
        if fmt == "zip":
            with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
                for arcname, item in members:
                    zf.writestr(arcname, item) if isinstance(item, bytes) else zf.write(item, arcname)
        else:
            write_tar(members, out, gzip=True)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def adapter_members(src: Path, card: AdapterCard) -> list[Member]:
    """The adapter's files with ``base_model_name_or_path`` made portable, the card as
    ``README.md`` and the base's tokenizer files (those the adapter directory lacks)."""
    members = [(name, path) for name, path in tree_members(src) if name != "README.md"]
    for i, (name, path) in enumerate(members):
        if name == "adapter_config.json" and isinstance(path, Path):
            config = json.loads(path.read_text())
            config["base_model_name_or_path"] = card.base_name
            members[i] = (name, json.dumps(config, indent=2, sort_keys=True).encode())
    present = {name for name, _ in members}
    if card.base_dir is not None:
        for name in TOKENIZER_FILES:
            path = card.base_dir / name
            if name not in present and path.is_file():
                members.append((name, path.resolve()))
    members.append(("README.md", card.readme.encode()))
    return members

