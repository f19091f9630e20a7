"""End-to-end stacks: a real uvicorn API and a real Celery worker, as separate processes.

Two stores, one fixture (``stack``, parametrized):

``postgres``  a fresh PostgreSQL database per session (``ftq db upgrade`` applies the
              migrations), Redis as broker and pub/sub on an empty Redis db; ``ftq api`` and
              ``ftq worker`` started separately, as in production.
``embedded``  ``ftq up`` with no URL set: SQLite store and SQLAlchemy broker in a tmp data dir.

Both authenticate as an admin made the way a user would: the embedded stack reads the key
that ``ftq up`` created on its first start and saved to the client config (``FTQ_CONFIG`` in
tmp); the PostgreSQL stack runs ``ftq users create e2e --admin`` and reads the printed key.

The model root holds a tiny random-weight Llama made by ``python -m trainer make-tiny-model``
and a copy whose weights file is garbage (a trainer that must fail). Without PostgreSQL or
Redis the ``postgres`` stack is skipped locally and fails under CI (``CI`` set).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

PG_ADMIN_URL = os.environ.get("FTQ_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("FTQ_TEST_REDIS", "redis://127.0.0.1:6379")
KEY_PATTERN = re.compile(r"ftq_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}")
MODEL = "tiny-llama"
CORRUPT_MODEL = "corrupt-llama"
WORDS = ("the cat sat on a mat and the dog ran in the park while birds sang songs of spring "
         "under a bright blue sky near the old stone bridge").split()

# Fast heartbeats and flushes so the tests see state changes quickly; a generous cancel grace
# so a slow CI box still lets the trainer write its checkpoint.
STACK_ENV = {
    "FTQ_HEARTBEAT_INTERVAL_S": "0.5",
    "FTQ_HEARTBEAT_TIMEOUT_S": "30",
    "FTQ_EVENT_FLUSH_INTERVAL_S": "0.2",
    "FTQ_CANCEL_GRACE_S": "60",
    "FTQ_SSE_POLL_INTERVAL_S": "0.2",
    "FTQ_ALLOW_HUB_MODELS": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # One intra-op thread: on a 2-core box shared with the API, the worker and pytest, OpenMP
    # spin-waiting of two threads made each tiny step ~30x slower.
    "OMP_NUM_THREADS": "1",
}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the end-to-end tests; scripts/services.sh starts it)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    """A running API + worker; ``url`` is the API's base URL."""

    name: str
    url: str
    data_dir: Path
    model_root: Path
    model: str = MODEL
    """A tiny random-weight Llama under ``model_root``."""
    corrupt_model: str = CORRUPT_MODEL
    """The same model with a garbage weights file: its trainer fails to load it."""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)
    api_key: str = ""
    """An admin's API key, sent by ``client()``."""
    env: dict[str, str] = field(default_factory=dict)
    """The stack's environment (store URLs, FTQ_CONFIG): for ``ftq users ...`` and client commands."""

    def client(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}", **kwargs.pop("headers", {})}
        return httpx.Client(base_url=self.url, timeout=30, headers=headers, **kwargs)

    def ftq(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``ftq ARGS`` against this stack's store and API (no API key from the environment)."""
        env = {k: v for k, v in self.env.items() if k != "FTQ_API_KEY"}
        env["FTQ_API_URL"] = self.url
        return subprocess.run([sys.executable, "-m", "cli", *args], env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def create_user(self, name: str, *extra: str) -> str:
        """``ftq users create NAME ...`` on the stack's store; the key it printed."""
        done = self.ftq("users", "create", name, *extra)
        assert done.returncode == 0, done.stderr
        return printed_key(done.stdout)

    def log_tail(self, lines: int = 60) -> str:
        parts = []
        for name, path in self.logs.items():
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            parts.append(f"--- {name} ({path}) ---\n" + "\n".join(text))
        return "\n".join(parts)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.data_dir.parent / f"{self.name}-{name}.log"
        self.logs[name] = log
        self.commands[name] = (argv, env)
        with log.open("ab") as sink:
            self.procs[name] = subprocess.Popen(
                argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self, name: str) -> None:
        """SIGKILL the process and its own process group (a Celery worker's pool), as a crash would."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart(self, name: str) -> None:
        argv, env = self.commands[name]
        self.start(name, argv, env)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the API answers and the worker has registered itself."""
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise AssertionError(f"{name} exited with {proc.returncode}\n{self.log_tail()}")
                try:
                    workers = client.get("/v1/hardware").json()["data"]
                    if workers and workers[0]["hardware"]:
                        return
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.3)
        raise AssertionError(f"the {self.name} stack was not ready in {timeout_s:.0f}s\n{self.log_tail()}")

    def stop(self) -> dict[str, int]:
        """SIGTERM to every process, then SIGKILL to what is left; returns the exit codes."""
        codes: dict[str, int] = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes[name] = proc.wait()
        return codes


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    subprocess.run(
        [sys.executable, "-m", "trainer", "make-tiny-model", str(root / MODEL), "--arch", "llama"],
        check=True, capture_output=True, timeout=300,
    )
    corrupt = root / CORRUPT_MODEL
    shutil.copytree(root / MODEL, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"this is not a safetensors file" * 100)
    return root


@pytest.fixture(scope="session")
def chat_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 short chat records over a small vocabulary: a tiny model learns it within steps."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for _ in range(64):
            question = " ".join(rng.choices(WORDS, k=6))
            answer = " ".join(rng.choices(WORDS[:8], k=12))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def printed_key(output: str) -> str:
    keys = KEY_PATTERN.findall(output)
    assert len(keys) == 1, f"expected the key printed once, found {len(keys)} in:\n{output}"
    return keys[0]


def _base_env(data_dir: Path, model_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
    env.update(STACK_ENV, FTQ_DATA_DIR=str(data_dir), FTQ_MODEL_ROOT=str(model_root),
               FTQ_CONFIG=str(data_dir.parent / "client-config.toml"))
    return env


def read_bootstrap_key(stack: Stack, timeout_s: float = 120.0) -> str:
    """The admin key ``ftq up`` saved to the client config on its first start."""
    import tomllib

    path = Path(stack.env["FTQ_CONFIG"])
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in stack.procs.values()):
            raise AssertionError(f"ftq up wrote no client config at {path}\n{stack.log_tail()}")
        time.sleep(0.2)
    return tomllib.loads(path.read_text())["api_key"]


@pytest.fixture(scope="module", params=["postgres", "embedded"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp(request.param)
    if request.param == "postgres":
        yield from _postgres_stack(base, model_root)
    else:
        yield from _embedded_stack(base, model_root)


def _embedded_stack(base: Path, model_root: Path) -> Iterator[Stack]:
    port = free_port()
    stack = Stack("embedded", f"http://127.0.0.1:{port}", base / "data", model_root)
    env = _base_env(stack.data_dir, model_root)
    env["FTQ_PORT"] = str(port)
    stack.env = env
    stack.start("up", [sys.executable, "-m", "cli", "up", "--no-demo-model"], env)
    try:
        stack.api_key = read_bootstrap_key(stack)
        stack.wait_ready()
        yield stack
    finally:
        codes = stack.stop()
    assert codes["up"] == 0, f"ftq up did not stop cleanly: {codes}\n{stack.log_tail()}"


def _postgres_stack(base: Path, model_root: Path, extra_env: dict[str, str] | None = None) -> Iterator[Stack]:
    import psycopg
    import redis

    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    db_name = f"ftq_e2e_{uuid.uuid4().hex[:12]}"
    redis_db = _empty_redis_db(redis)
    admin.execute(f'CREATE DATABASE "{db_name}"')
    port = free_port()
    stack = Stack("postgres", f"http://127.0.0.1:{port}", base / "data", model_root)
    env = _base_env(stack.data_dir, model_root)
    env.update(
        FTQ_DATABASE_URL=PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + "/" + db_name,
        FTQ_BROKER_URL=f"{REDIS_URL}/{redis_db}",
        FTQ_REDIS_URL=f"{REDIS_URL}/{redis_db}",
        FTQ_PORT=str(port),
    )
    env.update(extra_env or {})
    stack.env = env
    try:
        subprocess.run([sys.executable, "-m", "cli", "db", "upgrade"], env=env, check=True, capture_output=True,
                       timeout=120)
        stack.api_key = stack.create_user("e2e", "--admin")
        stack.start("api", [sys.executable, "-m", "cli", "api"], env)
        stack.start("worker", [sys.executable, "-m", "cli", "worker", "--name", f"e2e-{db_name}"], env)
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()
        client = redis.Redis.from_url(f"{REDIS_URL}/{redis_db}")
        client.flushdb()  # this db was empty when the session took it
        client.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        admin.close()


def _empty_redis_db(redis: Any) -> int:
    """A Redis db with no keys, so this session's queue shares nothing with anyone."""
    try:
        for db in range(14, 0, -1):  # 15 belongs to tests/integration/conftest.py
            client = redis.Redis.from_url(f"{REDIS_URL}/{db}", socket_connect_timeout=5)
            try:
                if client.dbsize() == 0:
                    return db
            finally:
                client.close()
    except redis.exceptions.ConnectionError as exc:
        _unavailable(f"Redis is not reachable at {REDIS_URL}: {exc}")
    _unavailable(f"Redis at {REDIS_URL} has no empty db among 1-14 for the end-to-end queue")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def fast_reaping_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """The PostgreSQL + Redis stack with a 4 s heartbeat timeout, for worker-loss tests."""
    yield from _postgres_stack(tmp_path_factory.mktemp("reaping"), model_root, {"FTQ_HEARTBEAT_TIMEOUT_S": "4"})
