"""A deployment over three "machines" (network namespaces, hosts.py): the API host runs its own
throwaway PostgreSQL and Redis (tests/faults/services.py, bound to its address) and ``ftq api``;
machines ``m1`` and ``m2`` each run one ``ftq worker`` as a remote worker would on another box.

What a worker machine shares with the API host: the network, nothing else on purpose. Each has
its own empty ``FTQ_DATA_DIR`` and its own copy of the models (``FTQ_MODEL_ROOT``), and runs in a
mount namespace of its own (``unshare --mount``) where the API host's directory and the other
machine's are hidden under an empty tmpfs, so a worker that reached for the API's files by path
would find nothing; and a hostname of its own (``unshare --uts``), as on another box, which its
own ``/etc/hosts`` maps to 127.0.1.1 as Debian and Ubuntu install it (so nothing may take the
hostname's address for the machine's address on the network). It knows
the API only by URL: ``FTQ_DATABASE_URL`` / ``FTQ_BROKER_URL`` at the API host's address (the
store is the channel, contract17), ``FTQ_API_URL`` + ``FTQ_WORKER_KEY`` for the bytes, and
``FTQ_WORKER_ADDRESS`` = its own address.

The test process reaches the API from inside the API host's namespace: ``client()`` and
``ftq()`` run in a block that joined it (``hosts.inside``), so their sockets are opened there.
Only this deployment's processes are ever signalled: they are the ones in its namespaces.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.faults.services import ThrowawayPostgres, ThrowawayRedis
from tests.fixtures.stack import MODEL, STACK_ENV, printed_key
from tests.netns.hosts import Hosts

REPO_ROOT = Path(__file__).resolve().parents[2]
API_PORT = 8000
PROXY_PORT = 8001
HEARTBEAT_TIMEOUT_S = 6
"""Short, so a killed machine's job is reaped within seconds (every worker's reaper uses it)."""


@dataclass
class Machine:
    """One worker machine: its namespace host name, its own directories, its worker."""

    name: str
    address: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)
    slots: int = 1
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def model_root(self) -> Path:
        return self.root / "models"

    @property
    def log(self) -> Path:
        return self.root / "worker.log"


@dataclass
class Cluster:
    hosts: Hosts
    base: Path
    pg: ThrowawayPostgres | None = None
    redis: ThrowawayRedis | None = None
    api_env: dict[str, str] = field(default_factory=dict)
    api_key: str = ""
    worker_keys: dict[str, str] = field(default_factory=dict)
    machines: dict[str, Machine] = field(default_factory=dict)
    api_proc: subprocess.Popen[bytes] | None = None
    proxy_proc: subprocess.Popen[bytes] | None = None
    model: str = MODEL

    @property
    def api_address(self) -> str:
        return self.hosts.addresses["api"]

    @property
    def api_url(self) -> str:
        return f"http://{self.api_address}:{API_PORT}"

    @property
    def api_root(self) -> Path:
        return self.base / "api"

    @property
    def api_data_dir(self) -> Path:
        return self.api_root / "data"

    # --- talking to the API, from the API host ---------------------------------------------

    @contextlib.contextmanager
    def client(self, key: str | None = None, **kwargs: Any) -> Iterator[httpx.Client]:
        """An HTTP client to the API whose sockets are opened in the API host's namespace: use it
        only inside this block."""
        headers = {"Authorization": f"Bearer {key or self.api_key}", **kwargs.pop("headers", {})}
        with self.hosts.inside("api"), httpx.Client(base_url=self.api_url, timeout=30, headers=headers,
                                                    **kwargs) as client:
            yield client

    def ftq(self, *args: str, api_key: str | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """``ftq ARGS`` run on the API host, against its store and API."""
        env = dict(self.api_env, FTQ_API_URL=self.api_url)
        if api_key:
            env["FTQ_API_KEY"] = api_key
        with self.hosts.inside("api"):
            return subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True,
                                  timeout=timeout_s, check=False, cwd=REPO_ROOT)

    def log_tail(self, lines: int = 40) -> str:
        logs = [("api", self.api_root / "api.log")] + [(m.name, m.log) for m in self.machines.values()]
        parts = []
        for name, path in logs:
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            parts.append(f"--- {name} ({path}) ---\n" + "\n".join(text))
        return "\n".join(parts)

    # --- the API host -----------------------------------------------------------------------

    def start_api_host(self, model_template: Path) -> None:
        self.api_root.mkdir(parents=True)
        shutil.copytree(model_template, self.api_root / "models" / self.model)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
        with self.hosts.inside("api"):
            self.pg = ThrowawayPostgres(self.api_root / "pgroot", host=self.api_address)
            self.redis = ThrowawayRedis(self.api_root / "redis", host=self.api_address)
            self.pg.start()
            self.redis.start()
        env.update(STACK_ENV, FTQ_DATA_DIR=str(self.api_data_dir), FTQ_MODEL_ROOT=str(self.api_root / "models"),
                   FTQ_CONFIG=str(self.api_root / "client-config.toml"), FTQ_DATABASE_URL=self.pg.url,
                   FTQ_BROKER_URL=self.redis.url, FTQ_REDIS_URL=self.redis.url, FTQ_HOST=self.api_address,
                   FTQ_PORT=str(API_PORT), FTQ_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S))
        self.api_env = env
        with self.hosts.inside("api"):
            subprocess.run([sys.executable, "-m", "cli", "db", "upgrade"], env=env, check=True, capture_output=True,
                           timeout=120, cwd=REPO_ROOT)
        done = self.ftq("users", "create", "netns", "--admin")
        assert done.returncode == 0, done.stderr
        self.api_key = printed_key(done.stdout)
        with self.hosts.inside("api"), (self.api_root / "api.log").open("ab") as log:
            self.api_proc = subprocess.Popen([sys.executable, "-m", "cli", "api"], env=env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT)
        self.wait(lambda: self._api_up(), "the API answered", timeout_s=120)

    def _api_up(self) -> bool:
        assert self.api_proc is not None
        if self.api_proc.poll() is not None:
            raise AssertionError(f"the API exited with {self.api_proc.returncode}\n{self.log_tail()}")
        try:
            with self.client() as client:
                return client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def create_worker_key(self, name: str) -> str:
        """``ftq workers key create NAME`` (through the API, as an admin)."""
        done = self.ftq("workers", "key", "create", name, api_key=self.api_key)
        assert done.returncode == 0, f"ftq workers key create {name}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        keys = [w for w in done.stdout.split() if w.startswith("ftqw_")]
        assert len(keys) == 1, f"expected the worker key printed once:\n{done.stdout}"
        return keys[0]

    # --- the corrupting proxy (proxy.py), on the API host ------------------------------------

    @property
    def proxy_url(self) -> str:
        return f"http://{self.api_address}:{PROXY_PORT}"

    @property
    def proxy_arm(self) -> Path:
        return self.api_root / "proxy.arm"

    def start_proxy(self) -> None:
        argv = [sys.executable, str(Path(__file__).with_name("proxy.py")), f"{self.api_address}:{PROXY_PORT}",
                f"{self.api_address}:{API_PORT}", str(self.api_root / "proxy.jsonl"), str(self.proxy_arm)]
        with self.hosts.inside("api"), (self.api_root / "proxy.log").open("ab") as log:
            self.proxy_proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def proxy_records(self) -> list[dict[str, Any]]:
        path = self.api_root / "proxy.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    # --- worker machines --------------------------------------------------------------------

    def add_machine(self, name: str, model_template: Path, *, api_url: str | None = None, slots: int = 1) -> Machine:
        machine = Machine(name, self.hosts.addresses[name], self.base / name, slots=slots)
        machine.data_dir.mkdir(parents=True)
        shutil.copytree(model_template, machine.model_root / self.model)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
        env.update(STACK_ENV, FTQ_DATA_DIR=str(machine.data_dir), FTQ_MODEL_ROOT=str(machine.model_root),
                   FTQ_DATABASE_URL=self.api_env["FTQ_DATABASE_URL"], FTQ_BROKER_URL=self.api_env["FTQ_BROKER_URL"],
                   FTQ_REDIS_URL=self.api_env["FTQ_REDIS_URL"], FTQ_API_URL=api_url or self.api_url,
                   FTQ_WORKER_ADDRESS=machine.address, FTQ_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
                   FTQ_CONFIG=str(machine.root / "client-config.toml"))
        if name in self.worker_keys:
            env["FTQ_WORKER_KEY"] = self.worker_keys[name]
        machine.env = env
        self.machines[name] = machine
        return machine

    def others(self, machine: Machine) -> list[Path]:
        """The directories ``machine`` must not see: the API host's and the other machines'."""
        return [self.api_root, *(m.root for m in self.machines.values() if m is not machine)]

    def start_worker(self, name: str, *, slots: int | None = None) -> None:
        machine = self.machines[name]
        machine.slots = slots or machine.slots
        hostname = f"{self.hosts.sid}-{name}"
        etc_hosts = machine.root / "etc-hosts"  # as Debian and Ubuntu write it: the hostname is 127.0.1.1
        etc_hosts.write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n")
        hide = "".join(f"mount -t tmpfs -o size=1m,mode=0700 ftq-hidden {p} && " for p in self.others(machine))
        script = (f"hostname {hostname} && mount --bind {etc_hosts} /etc/hosts && {hide}"
                  f"exec {sys.executable} -m cli worker --name {name} --slots {machine.slots}")
        with self.hosts.inside(name), machine.log.open("ab") as log:
            machine.proc = subprocess.Popen(["unshare", "--uts", "--mount", "--propagation", "private", "--",
                                             "sh", "-c", script], env=machine.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT)

    def stop_worker(self, name: str, timeout_s: float = 60) -> None:
        """SIGTERM the machine's worker (a warm shutdown), then whatever is left in its namespace."""
        machine = self.machines[name]
        if machine.proc is not None and machine.proc.poll() is None:
            machine.proc.terminate()
            try:
                machine.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.hosts.kill_all(name)
        if machine.proc is not None:
            machine.proc.wait()
        assert self.hosts.empty(name), f"{name}: processes left: {self.hosts.pids(name)}"

    def kill_machine(self, name: str) -> list[int]:
        """The machine dies: SIGKILL every process on it, then its network link goes down."""
        pids = self.hosts.kill_all(name)
        self.hosts.link_down(name)
        machine = self.machines[name]
        if machine.proc is not None:
            machine.proc.wait()
        assert self.hosts.empty(name), f"{name}: processes outlived SIGKILL: {self.hosts.pids(name)}"
        return pids

    def revive_machine(self, name: str) -> None:
        """Link up and the worker started again (on the same, not emptied, data directory)."""
        self.hosts.link_up(name)
        self.start_worker(name)

    def ensure_up(self) -> None:
        """Every machine linked and its worker running (a test before may have killed one)."""
        for name, machine in self.machines.items():
            if machine.proc is None or machine.proc.poll() is not None:
                self.hosts.kill_all(name)
                self.revive_machine(name)
        self.wait_workers(list(self.machines))

    def hardware(self) -> dict[str, Any]:
        with self.client() as client:
            return client.get("/v1/hardware").json()

    def wait_workers(self, names: list[str], timeout_s: float = 180) -> dict[str, Any]:
        """Until each named worker has registered with its detected hardware and is alive."""
        def ready() -> dict[str, Any] | None:
            for name in names:
                proc = self.machines[name].proc
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"worker {name} exited with {proc.returncode}\n{self.log_tail()}")
            try:
                listing = self.hardware()
            except (httpx.HTTPError, ValueError):
                return None
            rows = {w["id"]: w for w in listing.get("data", [])}
            if all(n in rows and rows[n]["hardware"] and rows[n].get("alive")
                   and len(rows[n]["gpus"]) == self.machines[n].slots for n in names):
                return listing
            return None

        return self.wait(ready, f"workers {names} registered", timeout_s=timeout_s)

    def wait(self, predicate: Any, what: str, timeout_s: float = 180, every_s: float = 0.3) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            time.sleep(every_s)
        raise AssertionError(f"never {what} within {timeout_s:.0f}s\n{self.log_tail()}")

    def diagnose(self, name: str) -> str:
        """What a stuck machine is doing, for a failure message: every thread's stack of its
        worker (Celery logs them on SIGUSR1) and the store's sessions with their waits and locks."""
        for pid in self.hosts.pids(name):
            with contextlib.suppress(OSError):
                if b"python" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                    os.kill(pid, signal.SIGUSR1)
        sessions = ""
        if self.pg is not None:
            query = ("SELECT a.pid, a.client_addr, a.state, a.xact_start, a.wait_event_type, a.wait_event, "
                     "pg_blocking_pids(a.pid), left(a.query, 160) FROM pg_stat_activity a "
                     "WHERE a.datname IS NOT NULL AND a.pid <> pg_backend_pid() ORDER BY a.xact_start")
            with contextlib.suppress(Exception), self.hosts.inside("api"), \
                    psycopg.connect(self.pg.url.replace("+psycopg", ""), connect_timeout=5) as conn:
                sessions = "\n".join(repr(row) for row in conn.execute(query).fetchall())
        time.sleep(2.0)
        return f"--- store sessions ---\n{sessions}\n{self.log_tail(lines=150)}"

    def stop(self) -> None:
        for name in self.machines:
            with contextlib.suppress(Exception):
                self.stop_worker(name, timeout_s=20)
        for proc in (self.proxy_proc, self.api_proc):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=20)
        for server in (self.redis, self.pg):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()


def tree_sha(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root`` (a single file: its name)."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    base = root.parent if root.is_file() else root
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
