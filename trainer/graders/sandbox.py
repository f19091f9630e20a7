"""Run a python grader's ``grade(sample, item)`` in a child process with limits.

The child (``sandbox_child.py``, started as ``python -I -S``: no site-packages, no environment,
an empty temporary directory as its working directory) sets its own limits before the grader
runs: CPU seconds (``RLIMIT_CPU``: SIGXCPU, then SIGKILL), address space (``RLIMIT_AS``: an
allocation past it is a ``MemoryError``), no file writes (``RLIMIT_FSIZE`` 0), no core files;
then an audit hook (``sys.addaudithook``, which the grader cannot remove) refuses ``open``,
every ``os.*`` event (fork, exec, system, posix_spawn, kill, listdir, remove, ...), sockets,
``subprocess``, ``ctypes`` and the import of any module not already loaded. ``RLIMIT_NPROC`` is
set too but does not bind root, so the hook is what stops a fork. This process keeps the wall
clock and the output size: past either it kills the child's process group. Each failure comes
back as a message for that item; nothing here raises for what the grader did.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("sandbox_child.py")


@dataclass(frozen=True)
class SandboxLimits:
    """What one ``grade`` call may use."""

    cpu_s: int = 10
    """CPU seconds (whole)."""
    wall_s: float = 20.0
    """Seconds from start to answer, interpreter start-up included."""
    memory_bytes: int = 1 << 30
    """Address space of the child (the interpreter's own ~30 MB included)."""
    output_bytes: int = 1 << 20
    """Bytes the child may write to its stdout and stderr in all."""
    log_chars: int = 64 * 1024
    """Characters the grader may print (shown with its result)."""


@dataclass(frozen=True)
class PythonOutcome:
    score: float | None
    """The grade, or None when the item failed (``error`` says why)."""
    error: str | None = None
    kind: str | None = None
    """``runtime`` (the grader raised), ``refused`` (a file, process or network operation),
    ``memory``, ``cpu``, ``wall``, ``output``, ``crashed``."""
    log: str = ""
    seconds: float = 0.0


def run_python(source: str, sample: dict[str, Any], item: Any, limits: SandboxLimits) -> PythonOutcome:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ftq-grader-") as workdir:
        payload = json.dumps({"source": source, "sample": sample, "item": item,
                              "limits": {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes,
                                         "log_chars": limits.log_chars, "workdir": workdir}})
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(CHILD)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir,
                                env={"LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}, start_new_session=True,
                                close_fds=True)
        try:
            _send(proc, payload)
            output, stopped = _collect(proc, started + limits.wall_s, limits.output_bytes)
        finally:
            _kill(proc)
        seconds = time.monotonic() - started
    if stopped:
        return PythonOutcome(None, *_STOPS[stopped](limits), seconds=seconds)
    return _read(output, proc.returncode, limits, seconds)


def _send(proc: subprocess.Popen[bytes], payload: str) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child died first; its exit status says why


def _collect(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, str | None]:
    """The child's output until it closes it, or ``wall``/``output`` when a limit stopped it."""
    assert proc.stdout is not None
    fd, chunks, size = proc.stdout.fileno(), [], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"", "wall"
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        size += len(chunk)
        if size > cap:
            return b"", "output"
        chunks.append(chunk)
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
        return b"", "wall"
    return b"".join(chunks), None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


_STOPS = {
    "wall": lambda limits: (f"the grader ran past its wall-time limit of {limits.wall_s:g} s and was killed", "wall"),
    "output": lambda limits: (f"the grader wrote more than {limits.output_bytes} bytes of output and was killed",
                              "output"),
}


def _read(output: bytes, returncode: int, limits: SandboxLimits, seconds: float) -> PythonOutcome:
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not output.strip():
        return PythonOutcome(None, f"the grader used more than its CPU-time limit of {limits.cpu_s} s and was "
                                   "killed", "cpu", seconds=seconds)
    lines = output.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or "ok" not in answer:
        tail = "\n".join(lines[-5:])[-1000:]
        return PythonOutcome(None, f"the grader's process ended without an answer (exit status {returncode})"
                                   f"{': ' + tail if tail else ''}", "crashed", seconds=seconds)
    if answer["ok"]:
        return PythonOutcome(float(answer["score"]), log=answer.get("log", ""), seconds=seconds)
    return PythonOutcome(None, str(answer.get("error")), str(answer.get("kind")), answer.get("log", ""), seconds)
