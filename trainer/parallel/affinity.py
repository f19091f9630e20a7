"""A rank's threads on the CPU cores next to its GPU (its NUMA node), ranks never sharing a core.

A small model's step is launch-bound: the host thread that queues kernels sets the pace. Several
ranks on one machine, each free to run on any core, measured slower per host operation than one
process (``aten::view`` +32%, ``cudaLaunchKernel`` +17% per call, 0.6B LoRA on 2 H200s; see
docs/benchmarks.md). ``pin`` restricts this process to the cores of its GPU's NUMA node (the PCI
device's ``local_cpulist`` in sysfs), split evenly between the local ranks whose GPUs share that
node, as torchrun's ``--numa-binding`` or NeMo's launchers do.

``FTQ_CPU_AFFINITY``: ``auto`` (pin when torchrun started several local ranks), ``on`` (pin a
single process too), ``off``. Linux only; anything missing (no sysfs entry, a torch whose device
properties have no PCI ids) leaves the process as it is, with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ENV = "FTQ_CPU_AFFINITY"
SYSFS = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format).

    Raises:
        ValueError: not a cpulist.
    """
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"cpulist range {part!r} runs backwards")
        cores.extend(range(first, last + 1))
    return cores


def gpu_cpus(index: int, sysfs: Path = SYSFS) -> list[int] | None:
    """The cores of CUDA device ``index``'s NUMA node, or None where that cannot be read."""
    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(i is None for i in ids):
        return None
    domain, bus, dev = ids
    path = sysfs / f"{domain:04x}:{bus:02x}:{dev:02x}.0" / "local_cpulist"
    try:
        return parse_cpulist(path.read_text()) or None
    except (OSError, ValueError):
        return None


def share(node_cpus: list[list[int] | None], local_rank: int, allowed: set[int]) -> list[int] | None:
    """This local rank's cores: its GPU's node's cores that this process may use, split in equal
    contiguous parts between the local ranks whose GPUs share that node (rank order)."""
    mine = node_cpus[local_rank]
    if mine is None:
        return None
    usable = [c for c in mine if c in allowed]
    peers = [r for r, cpus in enumerate(node_cpus) if cpus == mine]
    part = len(usable) // len(peers)
    if part == 0:
        return None
    k = peers.index(local_rank)
    return usable[k * part:(k + 1) * part]


def pin(local_rank: int, local_world_size: int, device: torch.device) -> str:
    """Restrict this process to its share of its GPU's node (see the module docstring); returns
    what was done, for the run's log."""
    mode = os.environ.get(ENV, "auto").lower()
    if mode not in ("auto", "on", "off"):
        return f"{ENV}={mode!r} is not auto, on or off: left unpinned"
    if device.type != "cuda" or mode == "off" or (mode == "auto" and local_world_size < 2):
        return "unpinned"
    if not hasattr(os, "sched_setaffinity"):
        return "unpinned: this OS has no sched_setaffinity"
    count = min(local_world_size, torch.cuda.device_count())
    chosen = share([gpu_cpus(i) for i in range(count)], local_rank, os.sched_getaffinity(0))
    if not chosen:
        return "unpinned: the GPU's NUMA node and its cores could not be read"
    os.sched_setaffinity(0, chosen)
    return f"pinned to cores {chosen[0]}-{chosen[-1]} ({len(chosen)}) beside GPU {device.index}"
