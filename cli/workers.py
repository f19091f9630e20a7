"""Which GPUs ``ftq worker`` holds: ``--gpu N``, ``--gpus all | 0,1,3``, ``--slots K``, or the default.

One worker per host holds its GPUs as one pool (worker/app.py) and runs a job on as many of
them as it asks for, each job pinned with ``CUDA_VISIBLE_DEVICES`` to the GPUs it reserved.
``all`` means the GPUs this process may use: those in ``CUDA_VISIBLE_DEVICES`` when it is set,
else every GPU ``nvidia-smi`` lists. On a box without GPUs ``all`` gives one CPU slot;
``--slots K`` gives K (a job of N "GPUs" then runs N ranks on the CPU, with gloo).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Mapping

from cli.errors import CliError

GPU_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")
"""One GPU as ``CUDA_VISIBLE_DEVICES`` names it: an index or a GPU/MIG UUID."""


def visible_gpus(env: Mapping[str, str] | None = None, *, query: Callable[[], list[str]] | None = None) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``CUDA_VISIBLE_DEVICES`` set (even empty) is the answer, read as CUDA reads it: up to the
    first entry that is not a GPU id (``-1`` hides every GPU). Unset: ask ``nvidia-smi``.
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return (query or _nvidia_smi_indices)()
    gpus = []
    for part in (p.strip() for p in raw.split(",")):
        if not GPU_ID.match(part):
            break
        gpus.append(part)
    return gpus


def parse_gpus(value: str, *, visible: Callable[[], list[str]] = visible_gpus) -> list[str | None]:
    """``--gpus`` → the pool's GPU ids, or ``[None]`` (one CPU slot) for ``all`` on a GPU-less box.

    Raises:
        CliError: an entry that is not a GPU index/UUID, an empty entry, or a repeated GPU.
    """
    value = value.strip()
    if value == "all":
        found = visible()
        return list(found) if found else [None]
    parts = [part.strip() for part in value.split(",")]
    for part in parts:
        if not GPU_ID.match(part):
            raise CliError(
                f"--gpus {value!r}: {part!r} is not a GPU; give `all` or GPU indices/UUIDs separated by "
                "commas, e.g. --gpus 0,1,3"
            )
    repeated = sorted({p for p in parts if parts.count(p) > 1})
    if repeated:
        raise CliError(f"--gpus {value!r}: GPU {', '.join(repeated)} is listed twice; name each GPU once")
    return list(parts)


def _nvidia_smi_indices() -> list[str]:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip().isdigit()]
