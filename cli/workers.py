"""``ftq worker --gpus all | 0,1,3``: one worker process per GPU, each pinned and supervised.

A worker owns one device and runs one job at a time (concurrency 1), so a box with N GPUs
runs N workers, each with ``CUDA_VISIBLE_DEVICES`` set to its GPU. ``all`` means the GPUs this
process may use: those in ``CUDA_VISIBLE_DEVICES`` when it is set, else every GPU
``nvidia-smi`` lists. On a box without GPUs ``all`` starts one CPU worker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping

from cli.errors import CliError
from cli.supervise import ChildSpec

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
    """``--gpus`` → one entry per worker: a GPU id, or None for the one CPU worker of a GPU-less box.

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
        raise CliError(f"--gpus {value!r}: GPU {', '.join(repeated)} is listed twice; one worker per GPU")
    return list(parts)


def worker_children(
    gpus: list[str | None], *, log_level: str, name: str | None, env: Mapping[str, str] | None = None
) -> list[ChildSpec]:
    """One ``ftq worker --gpu N`` per GPU, pinned with ``CUDA_VISIBLE_DEVICES=N``."""
    base_env = dict(os.environ if env is None else env)
    children = []
    for gpu in gpus:
        argv = [sys.executable, "-m", "cli", "--log-level", log_level, "worker"]
        child_env = dict(base_env)
        if gpu is not None:
            argv += ["--gpu", gpu]
            child_env["CUDA_VISIBLE_DEVICES"] = gpu
        label = f"gpu{gpu}" if gpu is not None else "cpu"
        if name:
            argv += ["--name", f"{name}/{label}"]
        children.append(ChildSpec(name=f"worker {label}", argv=argv, env=child_env))
    return children


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
