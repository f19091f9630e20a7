"""The embedded default (``ftq up``) leaves no orphans (issue 10): killed outright, its API and
worker follow it (parent-death signal); closing its terminal (SIGHUP) stops it as Ctrl-C does;
and a new ``ftq up`` stops what a dead one left, found through its pid file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cli import up_state
from tests.faults.services import free_port
from tests.integration.e2e.stack import STACK_ENV, Stack, read_bootstrap_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _alive(pid: int, start: int | None) -> bool:
    return start is not None and up_state.proc_start(pid) == start


def _gone(entries: dict, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(e["pid"], e["start"]) for e in entries.values()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _up(tmp_path: Path) -> Stack:
    port = free_port()
    stack = Stack("up", f"http://127.0.0.1:{port}", tmp_path / "data", tmp_path / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
    env.update(STACK_ENV, FTQ_DATA_DIR=str(stack.data_dir), FTQ_MODEL_ROOT=str(stack.model_root),
               FTQ_CONFIG=str(tmp_path / "client-config.toml"), FTQ_PORT=str(port), FTQ_CANCEL_GRACE_S="10")
    stack.env = env
    stack.start("up", [sys.executable, "-m", "cli", "up", "--no-demo-model"], env)
    return stack


def _wait_healthy(stack: Stack, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert stack.procs["up"].poll() is None, f"ftq up exited\n{stack.log_tail()}"
        try:
            if httpx.get(f"{stack.url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"ftq up did not serve {stack.url} in {timeout_s:.0f}s\n{stack.log_tail()}")


def test_kill_9_takes_the_children_along_and_sighup_stops_cleanly(tmp_path: Path) -> None:
    stack = _up(tmp_path)
    try:
        read_bootstrap_key(stack)
        _wait_healthy(stack)
        children = json.loads((stack.data_dir / up_state.PID_FILE).read_text())["children"]
        assert set(children) == {"api", "worker"} and all(e["start"] for e in children.values())

        stack.kill("up")  # SIGKILL to ftq up's process group; the children live in sessions of their own
        assert _gone(children, timeout_s=60), f"children outlived ftq up: {children}\n{stack.log_tail()}"

        stack.restart("up")  # the port and the store are free again
        _wait_healthy(stack)
        second = json.loads((stack.data_dir / up_state.PID_FILE).read_text())["children"]
        stack.procs["up"].send_signal(signal.SIGHUP)  # the terminal closed
        assert stack.procs["up"].wait(timeout=90) == 0, stack.log_tail()
        assert _gone(second, timeout_s=5)
        assert not (stack.data_dir / up_state.PID_FILE).exists()
    finally:
        stack.stop()


def test_a_new_instance_stops_what_a_dead_one_left(tmp_path: Path) -> None:
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        gone.wait()
        state = {"up": {"pid": gone.pid, "start": 1}, "port": 1,
                 "children": {"api": up_state.identity(left.pid), "worker": {"pid": gone.pid, "start": 1}}}
        (tmp_path / up_state.PID_FILE).write_text(json.dumps(state))
        said: list[str] = []
        assert up_state.stop_leftovers(tmp_path, grace_s=10, say=said.append) == ["api"]
        assert left.wait(timeout=10) == -signal.SIGTERM
        assert f"left its api (pid {left.pid})" in said[0]
        assert not (tmp_path / up_state.PID_FILE).exists()
    finally:
        left.kill()
        left.wait()


def test_a_live_instance_is_not_started_twice(tmp_path: Path) -> None:
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        state = {"up": up_state.identity(alive.pid), "port": 8123, "children": {}}
        (tmp_path / up_state.PID_FILE).write_text(json.dumps(state))
        with pytest.raises(up_state.AlreadyRunning, match=f"pid {alive.pid}, port 8123"):
            up_state.stop_leftovers(tmp_path, grace_s=1)
        assert alive.poll() is None
    finally:
        alive.kill()
        alive.wait()
