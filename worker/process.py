"""The trainer child process: its own session and process group, stdout events, stderr tail.

One GPU: the trainer itself. Several: torchrun, which starts one rank per GPU, each in a
session of its own (torch.distributed.elastic's ``SubprocessHandler``), so torchrun's process
group does not reach them. Every process of a job therefore carries a tag in its environment
(``FTQ_JOB_PROCESS``, inherited by ranks, data-loader workers and compile helpers alike), and
stopping the job reaches them by the tag (``/proc/<pid>/environ``), signalled through a pidfd
opened before the tag is read again, so a recycled pid is never signalled.

    terminate   SIGTERM to the ranks (torchrun's children), or to the trainer's group; each rank
                stops at a step boundary, rank 0 checkpoints, all exit 0, then torchrun does.
                (Not SIGTERM to torchrun: it forwards it but SIGKILLs the ranks 30 s later,
                which could cut a long checkpoint; ``cancel_grace_s`` is ours to enforce.)
    kill        SIGKILL to the group and to every tagged process
    finish      after the launcher exited: SIGKILL whatever still carries the tag (a rank that
                outlived torchrun), wait until none is left, then reap and drain

The group is killed while the launcher is still an unreaped zombie (``waitid(..., WNOWAIT)``),
so its pid, which names the group, cannot have been reused by an unrelated process. torchrun's
failure summary (which rank failed first, and how) and each rank's own stderr (torchrun's
``--log-dir``) come back in ``TrainerExit``.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from trainer.events import parse_line
from worker.oom import OomCounters, OomVerdict, verdict

log = logging.getLogger(__name__)


TAG_ENV = "FTQ_JOB_PROCESS"
"""Environment variable naming the job run a process belongs to (``<worker>|<job>|<attempt>``)."""
SUMMARY_LINES = 400
"""Lines of torchrun's stderr kept to find its failure summary (a block of ~7 lines per rank)."""


@dataclass(frozen=True)
class RankFailure:
    """A rank torchrun reports as failed."""

    rank: int
    exitcode: int
    """The exit code, or ``-N`` when signal N ended it."""
    root_cause: bool = False
    """torchrun's "first observed failure"."""


@dataclass(frozen=True)
class TrainerExit:
    returncode: int
    """The exit code, or ``-N`` when signal N ended the process (as ``subprocess`` reports it)."""
    stderr_tail: tuple[str, ...]
    """The last lines the trainer wrote to stderr (torchrun's, with every rank's prefixed)."""
    world_size: int = 1
    failures: tuple[RankFailure, ...] = ()
    """Several ranks: those torchrun reported as failed."""
    rank_tails: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Several ranks: the last stderr lines of each failed rank, from its own log."""
    oom: OomVerdict = OomVerdict.unknown
    """Whether the kernel's OOM killer ran during the run (``worker.oom``)."""
    oom_evidence: str = ""
    """The counters behind ``oom``, in words."""


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
        tag: str | None = None,
        ranks: int = 1,
        rank_log_dir: str | Path | None = None,
        stdin_pipe: bool = False,
    ) -> None:
        """``argv`` starts the trainer, or torchrun with ``ranks`` ranks writing each rank's
        stderr under ``rank_log_dir``; ``tag`` marks every process of the run (``TAG_ENV``)."""
        self.argv = list(argv)
        self._on_event = on_event
        self._env = dict(os.environ if env is None else env)
        if tag is not None:
            self._env[TAG_ENV] = tag
        self.tag = tag
        self.ranks = ranks
        self._rank_log_dir = Path(rank_log_dir) if rank_log_dir is not None else None
        self._cwd = cwd
        self._stderr_path = Path(stderr_path) if stderr_path is not None else None
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._summary: collections.deque[str] = collections.deque(maxlen=SUMMARY_LINES if ranks > 1 else 0)
        self._tail_lines = tail_lines
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._returncode: int | None = None
        self._oom_before: OomCounters | None = None
        self._stdin_pipe = stdin_pipe
        """A pipe to the trainer's stdin (a chat session's requests: ``write_line``); else /dev/null."""
        self._stdin_lock = threading.Lock()

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the trainer process has not been started")
        return self._proc.pid

    def start(self) -> None:
        self._oom_before = OomCounters.read()
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE if self._stdin_pipe else subprocess.DEVNULL,
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

    def write_line(self, line: str) -> bool:
        """Send one line to the trainer's stdin (``stdin_pipe``); False when it is closed or gone."""
        if self._proc is None or self._proc.stdin is None:
            return False
        with self._stdin_lock:
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return False
        return True

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
        """Send ``sig`` to the launcher's process group; False if nothing is left to signal."""
        if self._proc is None or self._returncode is not None:
            return False
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def terminate(self) -> bool:
        """Ask the run to stop (SIGTERM): every rank under torchrun, else the trainer's group."""
        if self._proc is None or self._returncode is not None:
            return False
        if self.ranks > 1:
            ranks = children_of(self.pid)
            if ranks:
                return signal_pids(ranks, signal.SIGTERM, tag=self.tag) > 0
        return self.signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the launcher's group and every process that carries the run's tag."""
        self.signal_group(signal.SIGKILL)
        if self.tag is not None:
            signal_tagged(self.tag, signal.SIGKILL)

    def finish(self, reader_timeout_s: float = 10.0) -> TrainerExit:
        """Kill whatever is left of the run, reap the launcher, drain its output; call once it
        exited (or to end it at once: every process of the run gets SIGKILL)."""
        if self._proc is None:
            raise RuntimeError("the trainer process has not been started")
        if self._returncode is None:
            self.kill()
            self._returncode = self._proc.wait()
        if self.tag is not None:
            left = wait_untagged(self.tag)
            if left:
                log.warning("processes %s of %s outlived SIGKILL", left, self.tag)
        if self._proc.stdin is not None:
            with self._stdin_lock:
                self._proc.stdin.close()
        for thread in self._threads:
            thread.join(timeout=reader_timeout_s)
            if thread.is_alive():
                log.warning("%s still reading after the trainer's group was killed", thread.name)
        oom, evidence = verdict(self._oom_before or OomCounters(None, None), OomCounters.read())
        if self.ranks == 1:
            return TrainerExit(self._returncode, tuple(self._tail), oom=oom, oom_evidence=evidence)
        failures = parse_torchrun_failures(self._summary)
        tails = {f.rank: self._rank_tail(f.rank) for f in failures}
        return TrainerExit(self._returncode, tuple(self._tail), self.ranks, failures, tails, oom, evidence)

    def _rank_tail(self, rank: int) -> tuple[str, ...]:
        """The last stderr lines of ``rank``: its own log under torchrun's log dir, else its
        prefixed lines in torchrun's stderr."""
        if self._rank_log_dir is not None:
            logs = sorted(self._rank_log_dir.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
            if logs:
                lines = logs[-1].read_text(errors="replace").splitlines()
                return tuple(lines[-self._tail_lines:]) if self._tail_lines else ()
        prefix = re.compile(rf"^\[[A-Za-z_]*{rank}\]:")
        mine = [prefix.sub("", line) for line in self._summary if prefix.match(line)]
        return tuple(mine[-self._tail_lines:]) if self._tail_lines else ()

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
                    line = raw.decode("utf-8", errors="replace").rstrip("\n")
                    self._tail.append(line)
                    self._summary.append(line)
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


_FAILURE_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)")


def parse_torchrun_failures(lines: Sequence[str]) -> tuple[RankFailure, ...]:
    """The ranks torchrun's failure summary names (``ChildFailedError``: "Failures:" then
    "Root Cause (first observed failure):", each a block with ``rank : R`` and ``exitcode : C``),
    root cause first; empty when there is no summary."""
    failures: list[RankFailure] = []
    root = False
    rank: int | None = None
    for line in lines:
        if "Root Cause" in line:
            root = True
        elif line.strip().startswith("Failures:"):
            root = False
        match = _FAILURE_FIELD.match(line)
        if match is None:
            continue
        if match.group(1) == "rank":
            rank = int(match.group(2))
        elif rank is not None:
            failures.append(RankFailure(rank, int(match.group(2)), root))
            rank = None
    unique = {(f.rank, f.exitcode): f for f in sorted(failures, key=lambda f: f.root_cause)}
    return tuple(sorted(unique.values(), key=lambda f: (not f.root_cause, f.rank)))


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries ``FTQ_JOB_PROCESS=<tag>`` (or, with a tag ending
    in ``|``, a value starting with it); empty where there is no ``/proc``."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if name.isdigit() and int(name) != os.getpid() and _has_tag(int(name), tag):
            found.append(int(name))
    return found


def tags_of(prefix: str) -> dict[int, str]:
    """pid → run tag of every live process whose tag starts with ``prefix``."""
    found = {}
    for pid in tagged_pids(prefix if prefix.endswith("|") else f"{prefix}|"):
        tag = _tag(pid)
        if tag is not None and tag.startswith(prefix):
            found[pid] = tag
    return found


def environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in process ``pid``'s environment (None: unset, or the process is
    gone, a zombie, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read()
    except OSError:
        return None
    needle = f"{name}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(needle):
            return entry[len(needle):].decode(errors="replace")
    return None


def _tag(pid: int) -> str | None:
    return environ_value(pid, TAG_ENV)


def _has_tag(pid: int, tag: str) -> bool:
    value = _tag(pid)
    return value is not None and (value == tag or (tag.endswith("|") and value.startswith(tag)))


def signal_if(pid: int, sig: signal.Signals, still: Callable[[int], bool]) -> bool:
    """Send ``sig`` to ``pid`` if ``still(pid)``, through a pidfd opened before the check, so a
    pid recycled meanwhile is left alone; whether it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if still(pid):
            signal.pidfd_send_signal(fd, sig)
            return True
    except OSError:
        pass
    finally:
        os.close(fd)
    return False


def signal_pids(pids: Sequence[int], sig: signal.Signals, *, tag: str | None = None) -> int:
    """Send ``sig`` to each pid still carrying ``tag`` (any, without one) (``signal_if``); returns
    how many were signalled."""
    return sum(signal_if(pid, sig, lambda p: tag is None or _has_tag(p, tag)) for pid in pids)


def signal_tagged(tag: str, sig: signal.Signals) -> int:
    """Send ``sig`` to every process of the run ``tag``; returns how many were signalled."""
    return signal_pids(tagged_pids(tag), sig, tag=tag)


def wait_untagged(tag: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL the run's processes until none is left (or ``timeout_s``); the pids left."""
    deadline = time.monotonic() + timeout_s
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        signal_pids(left, signal.SIGKILL, tag=tag)
        time.sleep(0.05)
    return left


def children_of(pid: int) -> list[int]:
    """The live direct children of ``pid`` (``/proc/*/stat``'s parent field)."""
    children = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and fields[0] != b"Z" and int(fields[1]) == pid:
            children.append(int(name))
    return children
