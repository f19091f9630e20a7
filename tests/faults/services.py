"""Throwaway PostgreSQL and Redis servers for the fault tests: each started by the test in a tmp
directory on a free port, killed (``kill -9``) and restarted by it, and ended by it. The
machine's own servers are never touched; only the pids these objects started are signalled.

PostgreSQL: ``initdb`` into ``<tmp>/pg`` (trust auth), ``postgres -D`` started directly (so its
pid is ours to kill) with its socket in the tmp dir. ``initdb`` refuses to run as root, so under
root the binaries run as the ``postgres`` user (``runuser``). Redis: ``redis-server`` with no
persistence (``--save '' --appendonly no``): a restart loses everything, as a crash of a
production Redis used only as broker and pub/sub may.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 60,
               host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:.0f} s")


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or ([shutil.which("initdb")] if shutil.which("initdb") else [])
    return Path(found[-1]).parent if found else None


class ThrowawayPostgres:
    """``host``: the address it listens on (another than 127.0.0.1 lets that address's network in,
    trust auth: the multi-machine tests' API host, in a network namespace of its own)."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        binaries = postgres_bin()
        if binaries is None:
            raise RuntimeError("no PostgreSQL binaries (initdb) under /usr/lib/postgresql/*/bin or on PATH")
        self.bin = binaries
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:  # pytest's tmp dirs are root's alone (0700): the postgres user needs its own
            root = Path(tempfile.mkdtemp(prefix="ftq-faults-pg-"))
            root.chmod(0o755)
            shutil.chown(root, "postgres")
        self.root = root
        self.data = root / "pg"
        self.host = host
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([*self._as, str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                        "--auth=trust", "--no-sync", "-E", "UTF8"], check=True, capture_output=True, timeout=120)
        if host != "127.0.0.1":
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {host}/24 trust\n")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{self.host}:{self.port}/postgres"

    def start(self) -> None:
        with (self.root / "postgres.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*self._as, str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-h", self.host,
                 "-k", str(self.root), "-c", "fsync=off", "-c", "full_page_writes=off"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        _wait_port(self.port, self.proc, "postgres", host=self.host)
        deadline = time.monotonic() + 60  # listening is not accepting: crash recovery runs first
        while subprocess.run([str(self.bin / "pg_isready"), "-h", self.host, "-p", str(self.port), "-q"],
                             check=False).returncode != 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"postgres on port {self.port} did not become ready")
            time.sleep(0.1)

    def kill9(self) -> None:
        """SIGKILL the postmaster and its backends (its process group), as a crash would."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10  # backends notice the postmaster is gone and exit
        while (self.data / "postmaster.pid").exists() and _pid_alive_in(self.data) and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # smart shutdown of what we started
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._as:
            shutil.rmtree(self.root, ignore_errors=True)


def _pid_alive_in(data: Path) -> bool:
    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
        return True
    except (OSError, ValueError, IndexError):
        return False


class ThrowawayRedis:
    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        self.root = root
        self.host = host
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> None:
        with (self.root / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", self.host, "--protected-mode", "no",
                 "--save", "", "--appendonly", "no",
                 "--dir", str(self.root)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        _wait_port(self.port, self.proc, "redis-server", host=self.host)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
