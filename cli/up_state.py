"""What a running ``ftq up`` leaves on disk, so the next one can find and stop what a dead one left.

``ftq up`` writes ``<data_dir>/up.json``: its own pid and those of its children (API, worker),
each with the process's start time from ``/proc/<pid>/stat``, so a pid the kernel has since given
to an unrelated process is never mistaken for ours. At the next start:

    the recorded ftq up is alive        refuse: one instance per data directory
    it is gone, children still alive    SIGTERM each child (the worker hands its running job back
                                        to the queue after the trainer checkpointed, as on Ctrl-C),
                                        SIGKILL its process group after the grace period
    nothing alive                       start as usual

Children also die with their parent: on Linux they are started with a parent-death signal
(``prctl(PR_SET_PDEATHSIG, SIGTERM)``), so a ``kill -9`` of ``ftq up`` or of its process group
stops them the same graceful way; the pid file is the net for what that misses (another OS, a
child that ignored the signal, an older ftq).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

PID_FILE = "up.json"
PR_SET_PDEATHSIG = 1


class AlreadyRunning(RuntimeError):
    """Another ``ftq up`` is alive on the same data directory."""


def proc_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot, ``/proc/<pid>/stat`` field 22); None if
    there is no such process (or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 and fields[0] != "Z" else None


def identity(pid: int) -> dict[str, int | None]:
    return {"pid": pid, "start": proc_start(pid)}


def is_alive(entry: dict[str, int | None]) -> bool:
    pid, start = entry.get("pid"), entry.get("start")
    return isinstance(pid, int) and start is not None and proc_start(pid) == start


def record(data_dir: Path, children: dict[str, int], port: int) -> Path:
    """Write the pid file of this ``ftq up`` and its children (atomically)."""
    path = data_dir / PID_FILE
    state = {"up": identity(os.getpid()), "port": port, "children": {n: identity(p) for n, p in children.items()}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return path


def clear(data_dir: Path) -> None:
    (data_dir / PID_FILE).unlink(missing_ok=True)


def stop_leftovers(data_dir: Path, *, grace_s: float, say: Callable[[str], None] = print) -> list[str]:
    """Stop the children a dead ``ftq up`` left behind; the names of those it stopped.

    Raises:
        AlreadyRunning: the recorded ``ftq up`` itself is alive.
    """
    path = data_dir / PID_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    up = state.get("up") or {}
    if is_alive(up) and up.get("pid") != os.getpid():
        raise AlreadyRunning(
            f"ftq up is already running on {data_dir} (pid {up['pid']}, port {state.get('port')}); "
            f"stop it (Ctrl-C in its terminal, or kill {up['pid']}) or use another FTQ_DATA_DIR"
        )
    left = {name: entry for name, entry in (state.get("children") or {}).items() if is_alive(entry)}
    for name, entry in left.items():
        say(f"ftq: a previous ftq up (pid {up.get('pid')}) died and left its {name} (pid {entry['pid']}); stopping it")
        _signal(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(is_alive(e) for e in left.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for name, entry in left.items():
        if is_alive(entry):
            say(f"ftq: the old {name} (pid {entry['pid']}) did not stop in {grace_s:g}s; killing it")
            _signal(entry["pid"], signal.SIGKILL, group=True)
    path.unlink(missing_ok=True)
    return sorted(left)


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies (Linux);
    None elsewhere. A parent that died before the call is caught by comparing the parent pid."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return arm


def _signal(pid: int, sig: signal.Signals, *, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)  # the children run in sessions of their own: pgid == pid
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
