"""Weight files checked from their headers alone, before anything loads them.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (each
tensor's ``dtype``, ``shape`` and ``data_offsets`` [begin, end) into the data that follows, plus
an optional ``__metadata__``), then the data. The safetensors library refuses a file whose size
is not exactly ``8 + n + max(end)`` ("incomplete metadata, file not fully covered"), which is what
an interrupted download or copy leaves behind. ``check_safetensors`` makes that comparison from
the header and the file's size, reading no tensor, so a submission (``core.jobs.model_source``)
or a download (``ftq models pull``) can refuse the file with its name and the fix instead of a
worker failing on it later.

A sharded model's ``model.safetensors.index.json`` names every shard its ``weight_map`` uses:
``check_shard_index`` reports the ones that are missing.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20
"""safetensors caps its JSON header at 100 MB; a larger length is not a safetensors file."""
INDEX_FILE = "model.safetensors.index.json"


class WeightsError(ValueError):
    """A weight file that cannot be loaded as it is; the message names the file and the fix."""


def check_safetensors(path: Path) -> dict[str, Any]:
    """Read ``path``'s header and check that the file holds exactly the bytes it declares.

    Returns:
        The header: tensor name -> ``{"dtype", "shape", "data_offsets"}``, and ``__metadata__``
        when present.

    Raises:
        WeightsError: unreadable, no valid header, or a size other than ``8 + header + data``.
    """
    name = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise _incomplete(name, f"it is {size} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES:
                raise WeightsError(f"{name}: header length {length} is not plausible; it is not a safetensors file")
            if 8 + length > size:
                raise _incomplete(name, f"it is {size} bytes, but its header alone declares {8 + length}")
            raw = fh.read(length)
    except OSError as exc:
        raise WeightsError(f"{name}: cannot be read ({exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{name}: the header is not JSON ({exc}); it is not a safetensors file") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{name}: the header is not a JSON object; it is not a safetensors file")
    expected = 8 + length + _data_bytes(name, header)
    if expected != size:
        problem = "incomplete" if size < expected else "longer than its header says"
        raise _incomplete(name, f"it is {size:,} bytes, but its header declares {expected:,} "
                          f"(8 + {length:,} header + {expected - 8 - length:,} tensor data): {problem}")
    return header


def check_shard_index(directory: Path) -> list[str]:
    """The shards ``directory``'s ``model.safetensors.index.json`` names that are not there
    (sorted; empty without an index).

    Raises:
        WeightsError: the index exists but is not a JSON object with a ``weight_map``.
    """
    index = directory / INDEX_FILE
    if not index.is_file():
        return []
    try:
        loaded = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{INDEX_FILE}: does not parse ({exc}); re-download it") from None
    weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{INDEX_FILE}: has no weight_map; re-download it")
    shards = {str(v) for v in weight_map.values()}
    return sorted(s for s in shards if not (directory / s).is_file())


def _data_bytes(name: str, header: dict[str, Any]) -> int:
    """The end of the last tensor's byte range (0 without tensors)."""
    end = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise WeightsError(f"{name}: tensor {key!r} has no valid data_offsets; it is not a safetensors "
                               "file, re-download it")
        end = max(end, offsets[1])
    return end


def _incomplete(name: str, why: str) -> WeightsError:
    return WeightsError(f"{name}: {why}; the file is damaged or was cut short (an interrupted download or "
                        "copy): re-download it")
