"""What a running ``ftq up`` leaves on disk and in its processes' environment, so that nothing of
an instance outlives it and the next one can stop whatever a dead one left.

Every process of an instance carries ``FTQ_UP_INSTANCE=<data_dir>#<pid>:<start>`` in its
environment (``instance_tag``: the data directory, and the pid and start time of its ``ftq up``):
the API and the worker get it from ``ftq up``, and everything they start inherits it (the
tokenizer pool's forkserver and processes, the trainer, torchrun's ranks), although those live in
sessions and process groups of their own. ``ftq up`` also writes ``<data_dir>/up.json``: its own
pid and those of its children, each with the process's start time from ``/proc/<pid>/stat``, so
a pid the kernel has since given to an unrelated process is never mistaken for ours.

When ``ftq up`` dies, however it dies:

    the children      get SIGTERM (a parent-death signal, ``prctl(PR_SET_PDEATHSIG)``): the
                      worker hands its running job back to the queue after the trainer
                      checkpointed, the API stops serving
    the guardian      (``guard``: a small untagged process in a session of its own, started
                      first, holding the read end of a pipe only ``ftq up`` writes to; its pid
                      is in ``up.json``) sees the pipe close, waits ``grace_s`` for them, then
                      SIGKILLs every process that still carries the tag (an API held open by
                      an SSE viewer, a worker stuck in its shutdown, a trainer whose worker
                      was killed) and exits

A ``kill -9`` of ``ftq up``'s process group reaches neither the children nor the guardian (their
sessions are their own); 2026-11-27 it left the API running for as long as a dashboard or
``ftq jobs follow`` kept an event stream open. At the next start (``stop_leftovers``):

    a recorded or tagged ftq up is alive   refuse: one instance per data directory
    it is gone, its processes are not      SIGTERM its recorded children (the graceful handback,
                                           as on Ctrl-C), wait ``grace_s`` for them and for
                                           every process of its tag, then SIGKILL what is left
                                           and wait until none is: the new worker never runs
                                           beside the old one on the same broker
    nothing alive                          start as usual
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from worker.process import environ_value, signal_if

PID_FILE = "up.json"
PR_SET_PDEATHSIG = 1
INSTANCE_ENV = "FTQ_UP_INSTANCE"
KILL_WAIT_S = 10.0
"""How long SIGKILLed processes get to be gone (they cannot refuse; a D-state process may lag)."""


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


def record(data_dir: Path, children: dict[str, int], port: int, guardian: int | None = None) -> Path:
    """Write the pid file of this ``ftq up``, its children and its guardian (atomically)."""
    path = data_dir / PID_FILE
    state = {"up": identity(os.getpid()), "port": port, "children": {n: identity(p) for n, p in children.items()},
             "guardian": identity(guardian) if guardian is not None else None}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return path


def clear(data_dir: Path) -> None:
    (data_dir / PID_FILE).unlink(missing_ok=True)


def instance_tag(data_dir: Path, pid: int | None = None) -> str:
    """The ``FTQ_UP_INSTANCE`` value of the ``ftq up`` ``pid`` (default: this process) on ``data_dir``."""
    pid = os.getpid() if pid is None else pid
    return f"{_tag_prefix(data_dir)}{pid}:{proc_start(pid)}"


def _tag_prefix(data_dir: Path) -> str:
    """What the tags of every instance on ``data_dir`` start with (``tagged`` matches the rest)."""
    return f"{data_dir.resolve()}#"


def _matches(value: str | None, key: str) -> bool:
    """``value`` is the tag ``key``, or (``key`` ending in ``#``) any instance's on its data directory."""
    return value == key or (key.endswith("#") and value is not None and value.startswith(key))


def _tag_owner(tag: str) -> dict[str, int | None]:
    """The ``identity`` of the ``ftq up`` that ``tag`` names."""
    pid, _, start = tag.rsplit("#", 1)[-1].partition(":")
    return {"pid": int(pid) if pid.isdigit() else None, "start": int(start) if start.isdigit() else None}


def tagged(key: str) -> dict[int, str]:
    """pid → ``FTQ_UP_INSTANCE`` of every live process but this one whose tag is ``key`` (a
    ``_tag_prefix``: of any instance on that data directory)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    found = {}
    for name in names:
        if name.isdigit() and int(name) != os.getpid():
            value = _instance_of(int(name))
            if value is not None and _matches(value, key):
                found[int(name)] = value
    return found


def _instance_of(pid: int) -> str | None:
    return environ_value(pid, INSTANCE_ENV)


def signal_tagged(pids: Iterable[int], key: str, sig: signal.Signals) -> None:
    """Send ``sig`` to each pid still tagged ``key`` (as ``tagged``), through a pidfd opened
    before the check, so a pid recycled meanwhile is left alone."""
    for pid in pids:
        signal_if(pid, sig, lambda p: _matches(_instance_of(p), key))


def kill_tagged(key: str, timeout_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL every process tagged ``key`` until none is left (or ``timeout_s``); the pids left."""
    deadline = time.monotonic() + timeout_s
    while (left := sorted(tagged(key))) and time.monotonic() < deadline:
        signal_tagged(left, key, signal.SIGKILL)
        time.sleep(0.05)
    return left


def stop_leftovers(data_dir: Path, *, grace_s: float, say: Callable[[str], None] = print) -> list[str]:
    """Stop every process a dead ``ftq up`` on ``data_dir`` left behind; the names of those it
    stopped (its recorded children by name, other processes of its tag as ``pid N``).

    Raises:
        AlreadyRunning: the recorded ``ftq up``, or the one a live process's tag names, is alive.
    """
    path = data_dir / PID_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    up = state.get("up") or {}
    prefix = _tag_prefix(data_dir)
    owners = [up, *(_tag_owner(tag) for tag in set(tagged(prefix).values()))]
    for owner in owners:
        if is_alive(owner) and owner.get("pid") != os.getpid():
            raise AlreadyRunning(
                f"ftq up is already running on {data_dir} (pid {owner['pid']}, port {state.get('port', '?')}); "
                f"stop it (Ctrl-C in its terminal, or kill {owner['pid']}) or use another FTQ_DATA_DIR"
            )
    left = {name: entry for name, entry in (state.get("children") or {}).items() if is_alive(entry)}
    for name, entry in left.items():
        say(f"ftq: a previous ftq up (pid {up.get('pid')}) died and left its {name} (pid {entry['pid']}); stopping it")
        _signal(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (any(is_alive(e) for e in left.values()) or tagged(prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for name, entry in left.items():
        if is_alive(entry):
            say(f"ftq: the old {name} (pid {entry['pid']}) did not stop in {grace_s:g}s; killing it")
            _signal(entry["pid"], signal.SIGKILL, group=True)
    others = sorted(tagged(prefix))
    if others:
        say(f"ftq: killing {len(others)} more processes of the previous ftq up: {others}")
    stuck = kill_tagged(prefix)
    if stuck:
        raise AlreadyRunning(f"processes of the previous ftq up on {data_dir} survived SIGKILL: {stuck}")
    guardian = state.get("guardian") or {}
    if is_alive(guardian):  # it has nothing left to guard
        _signal(guardian["pid"], signal.SIGKILL)
    path.unlink(missing_ok=True)
    return sorted(left) + [f"pid {pid}" for pid in others]


def start_guardian(tag: str, grace_s: float) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``guard`` for the instance ``tag``; returns it and the pipe end only this process
    holds (close it, or die, and the guardian sweeps the instance)."""
    read_end, write_end = os.pipe()  # not inheritable: no other child holds the write end
    try:
        guardian = subprocess.Popen(
            [sys.executable, "-m", "cli.up_state", "guard", tag, str(grace_s)], stdin=read_end,
            start_new_session=True,  # out of reach of a kill of ftq up's group; untagged: not its own target
        )
    finally:
        os.close(read_end)
    return guardian, write_end


def guard(tag: str, grace_s: float) -> None:
    """Wait for the end of ``ftq up`` (EOF on stdin), give its processes ``grace_s`` to stop
    (they got SIGTERM from their parent-death signal), then SIGKILL every process of ``tag``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while os.read(0, 1024):
        pass
    deadline = time.monotonic() + grace_s
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_tagged(tag)


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


if __name__ == "__main__":  # python -m cli.up_state guard TAG GRACE_S (start_guardian)
    guard(sys.argv[2], float(sys.argv[3]))
