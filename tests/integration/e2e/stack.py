"""A running end-to-end stack (API + worker processes) and what the tests read from it: the
``Stack`` handle, its environment, free ports, the API key a command printed or ``ftq up`` saved.
Plain helpers, not fixtures: the fixtures that start stacks are in conftest.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

KEY_PATTERN = re.compile(r"ftq_[0-9a-f]{8}_[A-Za-z0-9_-]{20,}")
MODEL = "tiny-llama"
CORRUPT_MODEL = "corrupt-llama"
POISONED_MODEL = "poisoned-llama"

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
    worker_id: str = ""
    """The worker's ``--name`` where the stack sets one."""

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


def printed_key(output: str) -> str:
    keys = KEY_PATTERN.findall(output)
    assert len(keys) == 1, f"expected the key printed once, found {len(keys)} in:\n{output}"
    return keys[0]


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
