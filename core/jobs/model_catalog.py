"""The local models a job may name: directories under ``FTQ_MODEL_ROOT`` holding ``config.json``.

A model directory is found by walking the root (at most ``MAX_DEPTH`` levels, so
``org/name`` layouts work), never descending into a model once found (its ``checkpoint-*``
folders are not models of their own), skipping hidden entries and never following a symlink
out of the root. The name is the path relative to the root, exactly what ``POST /v1/jobs``
accepts as ``model`` (``core.jobs.model_source.resolve_model``).

Parameter counts come from the safetensors headers (8-byte length + JSON of dtypes and
shapes): exact, and cheap because no tensor is read. Models saved only as ``.bin`` pickles
report ``params: null`` rather than being unpickled.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import InvalidInput
from core.jobs.model_source import check_model_files

MAX_DEPTH = 3
MAX_MODELS = 500
MAX_HEADER_BYTES = 100 << 20
"""safetensors caps its JSON header at 100 MB; anything larger is not a safetensors file."""


@dataclass(frozen=True)
class LocalModel:
    name: str
    """Path relative to the model root, with ``/`` separators: the job's ``model`` value."""
    model_type: str | None
    """``config.json`` ``model_type`` (e.g. ``llama``, ``qwen3``)."""
    architectures: tuple[str, ...]
    """``config.json`` ``architectures`` (e.g. ``LlamaForCausalLM``)."""
    bytes: int
    """Size on disk of every file in the directory (checkpoints included)."""
    params: int | None
    """Parameters in the weights (from safetensors headers); None when unknown."""
    error: str | None = None
    """Why the model's files could not be read fully (an unreadable config.json, a bad header)."""
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """config.json as parsed (empty when unreadable): the sizes ``api.models.fit`` estimates from."""


def find_models(model_root: Path) -> list[LocalModel]:
    """Every model directory under ``model_root``, sorted by name; empty if the root is missing."""
    root = model_root.expanduser().resolve()
    return [describe_model(directory, root) for directory in model_dirs(model_root).values()]


def model_dirs(model_root: Path) -> dict[str, Path]:
    """``{name: directory}`` of the models ``find_models`` describes, by name, without reading them."""
    root = model_root.expanduser().resolve()
    if not root.is_dir():
        return {}
    found = {directory.relative_to(root).as_posix(): directory for directory in _model_dirs(root)[:MAX_MODELS]}
    return dict(sorted(found.items()))


def describe_model(directory: Path, root: Path) -> LocalModel:
    """Read ``directory``'s config.json and weight headers; problems go into ``error``."""
    name = directory.relative_to(root).as_posix()
    errors: list[str] = []
    config: dict[str, Any] = {}
    try:
        loaded = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
        if not isinstance(loaded, dict):
            errors.append("config.json is not a JSON object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        errors.append(f"config.json unreadable: {exc}")
    architectures = config.get("architectures") or ()
    params, weight_error = count_params(directory)
    if weight_error:
        errors.append(weight_error)
    elif config and params is not None:
        try:  # the submission's own check: a config.json that does not describe the weights
            check_model_files(directory, name)
        except InvalidInput as exc:
            errors.append(exc.message)
    return LocalModel(
        name=name,
        model_type=config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        architectures=tuple(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else (),
        bytes=_dir_bytes(directory),
        params=params,
        error="; ".join(errors) or None,
        config=config,
    )


def count_params(directory: Path) -> tuple[int | None, str | None]:
    """Sum of tensor sizes over the top-level ``*.safetensors`` files; (None, None) without any."""
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        return None, None
    total = 0
    for path in files:
        try:
            total += _safetensors_params(path)
        except (OSError, ValueError) as exc:
            return None, f"{path.name}: {exc}"
    return total, None


def _safetensors_params(path: Path) -> int:
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"header length {size} is not plausible; not a safetensors file")
        raw = fh.read(size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON ({exc}); not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object; not a safetensors file")
    total = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"tensor {key!r} has no valid shape")
        total += math.prod(shape)
    return total


def _model_dirs(root: Path) -> list[Path]:
    """Breadth-first, bounded walk; a directory with config.json is a model and a leaf."""
    out: list[Path] = []
    level = [root]
    for depth in range(MAX_DEPTH + 1):
        below: list[Path] = []
        for directory in level:
            if depth > 0 and (directory / "config.json").is_file():
                out.append(directory)
                continue
            if depth < MAX_DEPTH:
                below.extend(_subdirs(directory, root))
        level = below
    return out


def _subdirs(directory: Path, root: Path) -> list[Path]:
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    subdirs = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        path = Path(entry.path)
        if entry.is_symlink():
            target = path.resolve()
            if target != root and root not in target.parents:
                continue
        subdirs.append(path)
    return subdirs


def _dir_bytes(directory: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(directory):
        for filename in filenames:
            try:
                total += os.stat(os.path.join(dirpath, filename), follow_symlinks=False).st_size
            except OSError:
                continue
    return total
