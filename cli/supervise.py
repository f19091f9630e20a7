"""Child processes started and stopped together: ``ftq worker --gpus`` runs one worker per GPU.

Each child runs in its own session, so a Ctrl-C in the terminal reaches only the supervisor,
which then stops every child the same way: SIGTERM to the child's main process (a worker
hands its running job back to the queue once the trainer has checkpointed), SIGKILL to the
child's process group if it is still running after its grace period. A second Ctrl-C kills
at once. If any child dies, the rest are stopped and the supervisor reports which one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: Mapping[str, str]


class Supervisor:
    """Starts ``children``, waits for a stop signal or a child's death, then stops them all."""

    def __init__(self, children: Sequence[ChildSpec], *, grace_s: float, poll_s: float = 0.5) -> None:
        if not children:
            raise ValueError("children: give at least one process to supervise")
        self._specs = list(children)
        self._grace_s = grace_s
        self._poll_s = poll_s
        self.stop_requested = threading.Event()
        self._kill_now = threading.Event()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def request_stop(self, *_: object) -> None:
        """Signal handler: the first call stops the children gracefully, a second kills them."""
        if self.stop_requested.is_set():
            self._kill_now.set()
        self.stop_requested.set()

    def run(self, *, handle_signals: bool = True) -> int:
        """0 after a requested stop; 1 if a child exited on its own (the others are stopped)."""
        previous = {}
        if handle_signals:
            previous = {sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        died: str | None = None
        try:
            for spec in self._specs:
                self.procs[spec.name] = subprocess.Popen(list(spec.argv), env=dict(spec.env), start_new_session=True)
            died = self._wait()
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if died is not None:
            print(f"ftq: {died} exited unexpectedly (code {self.procs[died].returncode}); stopped the others",
                  file=sys.stderr)
            return 1
        return 0

    def _wait(self) -> str | None:
        while not self.stop_requested.wait(self._poll_s):
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    return name
        return None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the main process only: it shuts its pool down itself
        deadline = threading.Event()
        timer = threading.Timer(self._grace_s, deadline.set)
        timer.daemon = True
        timer.start()
        try:
            for name, proc in self.procs.items():
                while proc.poll() is None and not deadline.is_set() and not self._kill_now.is_set():
                    self._kill_now.wait(0.1)
                if proc.poll() is None:
                    print(f"ftq: {name} did not stop in time; killing it", file=sys.stderr)
                    _kill_group(proc)
                    proc.wait()
        finally:
            timer.cancel()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
