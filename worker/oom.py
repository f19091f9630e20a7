"""Did the kernel's out-of-memory killer run while a trainer ran? Read where the kernel counts it.

A trainer that dies by SIGKILL without a final event was either killed by the OOM killer (host
RAM, or its cgroup's memory limit, ran out) or by someone outside (``kill -9``, a supervisor, a
container runtime). Only the first is cured by a smaller batch; the second is worth a retry from
the last checkpoint. The kernel counts its OOM kills in two places every user can read:

    /proc/vmstat              oom_kill N    every OOM kill on the machine since boot (Linux >= 4.13;
                                            memory-cgroup kills included)
    <cgroup>/memory.events    oom_kill N    cgroup v2: kills in the worker's cgroup and below
    <cgroup>/memory.oom_control oom_kill N  cgroup v1 (memory controller)

``OomCounters.read()`` is taken when the trainer starts and again after it exits; a counter that
moved is evidence of an OOM kill. The system counter also moves for an unrelated process's
OOM kill during the run, so the verdict leans towards "out of memory" (the advice is still
right, and nothing is retried that should not be). ``dmesg`` is not read: it is often closed to
unprivileged users, and the counters say the same thing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

VMSTAT = Path("/proc/vmstat")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class OomVerdict(str, enum.Enum):
    oom = "oom"
    """A counter moved: the OOM killer ran during the run."""
    not_oom = "not_oom"
    """Every counter that could be read stayed put: the kill came from outside."""
    unknown = "unknown"
    """No counter could be read (no /proc/vmstat, a kernel before 4.13)."""


@dataclass(frozen=True)
class OomCounters:
    system: int | None
    """``oom_kill`` of /proc/vmstat; None when unreadable."""
    cgroup: int | None
    """``oom_kill`` of this process's memory cgroup; None when unreadable."""
    cgroup_file: str | None = None

    @classmethod
    def read(cls, vmstat: Path = VMSTAT, cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> OomCounters:
        events = _cgroup_events_file(self_cgroup, cgroup_root)
        return cls(
            system=_counter(vmstat, "oom_kill"),
            cgroup=_counter(events, "oom_kill") if events is not None else None,
            cgroup_file=str(events) if events is not None else None,
        )


def verdict(before: OomCounters, after: OomCounters) -> tuple[OomVerdict, str]:
    """The verdict and the evidence, in words, for the job's message."""
    moved: list[str] = []
    read: list[str] = []
    for label, old, new in (
        ("/proc/vmstat oom_kill", before.system, after.system),
        (f"{after.cgroup_file} oom_kill", before.cgroup, after.cgroup),
    ):
        if old is None or new is None:
            continue
        read.append(f"{label} {old} -> {new}")
        if new > old:
            moved.append(f"{label} {old} -> {new}")
    if moved:
        return OomVerdict.oom, "the kernel counted an OOM kill during the run (" + "; ".join(moved) + ")"
    if read:
        return OomVerdict.not_oom, "the kernel counted no OOM kill during the run (" + "; ".join(read) + ")"
    return OomVerdict.unknown, "the kernel's OOM counters could not be read (/proc/vmstat, memory.events)"


def _cgroup_events_file(self_cgroup: Path, root: Path) -> Path | None:
    """This process's cgroup v2 ``memory.events``, or its v1 ``memory.oom_control``."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            candidate = root / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            candidate = root / "memory" / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        if candidate.is_file():
            return candidate
    return None


def _counter(path: Path, name: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value.strip())
    return None
