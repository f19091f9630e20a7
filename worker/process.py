"""The trainer child process: its own session and process group, stdout events, stderr tail.

The trainer may start helpers (data-loader processes, compile workers); all of them inherit
its process group, so one ``killpg`` reaches every process that could hold GPU memory. The
group is killed while the trainer is still an unreaped zombie (``waitid(..., WNOWAIT)``), so
its pid, which names the group, cannot have been reused by an unrelated process.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from trainer.events import parse_line

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerExit:
    returncode: int
    """The exit code, or ``-N`` when signal N ended the process (as ``subprocess`` reports it)."""
    stderr_tail: tuple[str, ...]
    """The last lines the trainer wrote to stderr."""


class TrainerProcess:
    """Runs ``argv`` in a new session; hands each stdout event to ``on_event``; keeps stderr."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        on_event: Callable[[dict[str, Any]], None],
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        stderr_path: str | Path | None = None,
        tail_lines: int = 40,
    ) -> None:
        self.argv = list(argv)
        self._on_event = on_event
        self._env = env
        self._cwd = cwd
        self._stderr_path = Path(stderr_path) if stderr_path is not None else None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._returncode: int | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the trainer process has not been started")
        return self._proc.pid

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env,
            cwd=self._cwd,
            start_new_session=True,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._read_stdout, args=(self._proc.stdout,), name="trainer-stdout", daemon=True),
            threading.Thread(target=self._read_stderr, args=(self._proc.stderr,), name="trainer-stderr", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def has_exited(self) -> bool:
        """True once the trainer has exited; it stays a zombie (its pid reserved) until ``finish``."""
        if self._returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def signal_group(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the trainer's whole process group; False if nothing is left to signal."""
        if self._proc is None or self._returncode is not None:
            return False
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def finish(self, reader_timeout_s: float = 10.0) -> TrainerExit:
        """Kill whatever is left of the group, reap the trainer, drain its output; call once it exited
        (or to end it at once: the group gets SIGKILL)."""
        if self._proc is None:
            raise RuntimeError("the trainer process has not been started")
        if self._returncode is None:
            self.signal_group(signal.SIGKILL)
            self._returncode = self._proc.wait()
        for thread in self._threads:
            thread.join(timeout=reader_timeout_s)
            if thread.is_alive():
                log.warning("%s still reading after the trainer's group was killed", thread.name)
        return TrainerExit(returncode=self._returncode, stderr_tail=tuple(self._tail))

    def _read_stdout(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                event = parse_line(raw)
                if event is None:
                    if raw.strip():
                        log.debug("trainer stdout: %s", raw.decode("utf-8", errors="replace").rstrip())
                    continue
                try:
                    self._on_event(event)
                except Exception:  # noqa: BLE001 - a bad event must not stop the reading
                    log.exception("could not handle trainer event %r", event.get("type"))

    def _read_stderr(self, stream: IO[bytes]) -> None:
        sink = self._stderr_path.open("ab") if self._stderr_path is not None else None
        try:
            with stream:
                for raw in iter(stream.readline, b""):
                    if sink is not None:
                        sink.write(raw)
                        sink.flush()
                    self._tail.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
        finally:
            if sink is not None:
                sink.close()


def signal_name(returncode: int) -> str | None:
    """``SIGKILL`` for -9; None when the process exited by itself."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
