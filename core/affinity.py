"""``FTQ_CPUS``: pin a process (and the processes it starts) to some CPU cores.

On a box the API shares with the trainer, the API under load takes CPU time from the trainer's
steps (issue 10: +54% step time at 20 submissions/s on 2 shared cores). Giving each its own cores
keeps the trainer's step time: ``FTQ_CPUS=0 ftq api`` and ``FTQ_CPUS=1-15 ftq worker``. The
worker's trainers inherit the worker's cores. Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import os


def parse_cpus(spec: str) -> set[int]:
    """``"0"``, ``"0-3"``, ``"0,2-3"`` → the set of core numbers.

    Raises:
        ValueError: the text is not such a list, or a range runs backwards.
    """
    cores: set[int] = set()
    for part in spec.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"FTQ_CPUS={spec!r}: write core numbers and ranges, e.g. 0 or 0-3 or 0,2-3")
        low, high = int(first), int(last) if sep else int(first)
        if high < low:
            raise ValueError(f"FTQ_CPUS={spec!r}: the range {part.strip()} runs backwards")
        cores.update(range(low, high + 1))
    return cores


def pin_process(spec: str | None) -> set[int] | None:
    """Pin this process to the cores ``spec`` names (None or empty: leave it as it is).

    Raises:
        ValueError: ``spec`` does not parse, names no core this machine has, or the OS has no
            CPU affinity (not Linux).
    """
    if not spec or not spec.strip():
        return None
    cores = parse_cpus(spec)
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("FTQ_CPUS: this OS cannot pin a process to cores (Linux only); unset it")
    machine = set(range(os.cpu_count() or 1))  # not this process's current set: a child may widen it
    if not cores & machine:
        raise ValueError(f"FTQ_CPUS={spec!r}: none of these cores is available here (this machine has "
                         f"0-{max(machine)})")
    try:
        os.sched_setaffinity(0, cores & machine)
    except OSError as exc:  # outside the container's cpuset
        raise ValueError(f"FTQ_CPUS={spec!r}: cannot run on those cores here ({exc})") from None
    return cores & machine
