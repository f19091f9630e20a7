"""The embedded default (``ftq up``) leaves no orphans (issue 10, issue 23 item 10): killed outright,
its API and worker follow it (parent-death signal) and its guardian kills whatever of the
instance is left after the grace period; closing its terminal (SIGHUP) stops it as Ctrl-C does;
and a new ``ftq up`` stops what a dead one left, found through its pid file and the instance tag
every process of it carries, before it starts its own worker.

Issue 23: a ``kill -9`` of ``ftq up``'s process group while a job trained and a viewer followed
its events left the API running (uvicorn's graceful shutdown waits for the open event stream)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cli import up_state
from tests.faults.services import free_port
from tests.fixtures.stack import MODEL, STACK_ENV, Stack, read_bootstrap_key

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


def _untagged(key: str, timeout_s: float) -> bool:
    """No process carries ``key``'s tag (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while up_state.tagged(key):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _up(tmp_path: Path, model_root: Path | None = None) -> Stack:
    port = free_port()
    stack = Stack("up", f"http://127.0.0.1:{port}", tmp_path / "data", model_root or tmp_path / "models")
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


def _key(stack: Stack) -> str:
    """The tag key of every ``ftq up`` instance on the stack's data directory."""
    return f"{stack.data_dir.resolve()}#"


def _commands(pids) -> dict[int, str]:
    found = {}
    for pid in pids:
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return found


def _workers(stack: Stack) -> list[int]:
    """Every ``ftq worker`` process on the stack's data directory, of any instance."""
    return [pid for pid, cmd in _commands(up_state.tagged(_key(stack))).items() if " -m cli " in cmd and " worker" in cmd]


def _training(stack: Stack, client: httpx.Client, dataset: Path, timeout_s: float = 300) -> tuple[str, int]:
    """Submit a long job and wait until its trainer has reported a step; the job id and the trainer's pid."""
    with dataset.open("rb") as f:
        file_id = client.post("/v1/files", files={"file": ("train.jsonl", f)}, data={"purpose": "train"}).json()["id"]
    created = client.post("/v1/jobs", json={"model": MODEL, "training_file": file_id,
                                            "hyperparameters": {"max_steps": 100_000}, "checkpoint_every": 5})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        trainers = [pid for pid, cmd in _commands(up_state.tagged(_key(stack))).items() if "-m trainer run" in cmd]
        if job["status"] == "running" and (job.get("progress") or {}).get("step", 0) >= 1 and trainers:
            return job_id, trainers[0]
        assert job["status"] in ("queued", "running"), job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not start training in {timeout_s:.0f}s\n{stack.log_tail()}")


def _follow(stack: Stack, job_id: str) -> threading.Event:
    """A viewer of the job's event stream (the dashboard, ``ftq jobs follow``), kept open in a thread
    until the server goes; the event is set once the first event arrived."""
    started = threading.Event()

    def read() -> None:
        try:
            with stack.client() as client, client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=None) as stream:
                for _ in stream.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass

    threading.Thread(target=read, daemon=True).start()
    return started


def test_kill_9_mid_job_leaves_no_process_a_restart_runs_one_worker_and_sighup_stops_cleanly(
    tmp_path: Path, fault_model_root: Path, chat_dataset: Path
) -> None:
    """kill -9 of ``ftq up``'s process group: its API and worker (children in sessions of their
    own), the trainer and the guardian all go; a restart finds the port and the store free and
    starts one worker; closing its terminal (SIGHUP) then stops it cleanly, as Ctrl-C and SIGTERM do
    (one handler; SIGTERM's exit 0 is also asserted by the embedded stack of tests/integration/e2e)."""
    stack = _up(tmp_path, fault_model_root)
    key = _key(stack)
    try:
        stack.api_key = read_bootstrap_key(stack)
        _wait_healthy(stack)
        children = json.loads((stack.data_dir / up_state.PID_FILE).read_text())["children"]
        assert set(children) == {"api", "worker"} and all(e["start"] for e in children.values())
        with stack.client() as client:
            job_id, trainer = _training(stack, client, chat_dataset)
        assert _follow(stack, job_id).wait(timeout=30), "the event stream sent nothing"
        state = json.loads((stack.data_dir / up_state.PID_FILE).read_text())
        instance = _commands(up_state.tagged(key))
        assert {state["children"]["api"]["pid"], state["children"]["worker"]["pid"], trainer} <= set(instance)

        everything = {str(pid): up_state.identity(pid) for pid in instance} | {"guardian": state["guardian"]}
        stack.kill("up")  # kill -9 of ftq up's process group, as the attack did
        grace_s = 10 + 30  # FTQ_CANCEL_GRACE_S + 30, the guardian's wait
        assert _gone(everything, timeout_s=grace_s + 30), (
            f"left after kill -9: {_commands(up_state.tagged(key))}\n{stack.log_tail()}")
        # the children's own children were signalled by the guardian before it left; each is gone
        # once the kernel has delivered its SIGKILL (a moment longer on a loaded machine)
        assert _untagged(key, timeout_s=15), f"left after kill -9: {_commands(up_state.tagged(key))}"

        stack.restart("up")  # the port and the store are free again
        _wait_healthy(stack)
        assert len(_workers(stack)) == 1, _commands(up_state.tagged(key))
        with stack.client() as client:
            assert client.get(f"/v1/jobs/{job_id}").json()["status"] in ("queued", "running")
        second = json.loads((stack.data_dir / up_state.PID_FILE).read_text())["children"]
        stack.procs["up"].send_signal(signal.SIGHUP)  # the terminal closed
        assert stack.procs["up"].wait(timeout=120) == 0, stack.log_tail()
        assert _gone(second, timeout_s=5)
        assert not (stack.data_dir / up_state.PID_FILE).exists()
        assert up_state.tagged(key) == {}
    finally:
        stack.stop()
        up_state.kill_tagged(key)


def test_a_restart_kills_the_processes_only_the_tag_names(tmp_path: Path) -> None:
    """A trainer whose worker was killed is in no pid file; the tag finds it, and the restart
    SIGKILLs it after the grace period, before its own worker starts."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tag = f"{tmp_path.resolve()}#{gone.pid}:1"
    orphan = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); time.sleep(300)"], env={**os.environ, up_state.INSTANCE_ENV: tag},
                              start_new_session=True)
    try:
        _wait_tagged(tmp_path, orphan.pid)
        said: list[str] = []
        assert up_state.stop_leftovers(tmp_path, grace_s=1, say=said.append) == [f"pid {orphan.pid}"]
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert said == [f"ftq: killing 1 more processes of the previous ftq up: [{orphan.pid}]"]
    finally:
        orphan.kill()
        orphan.wait()


def test_a_live_instance_found_by_its_tag_alone_is_not_started_twice(tmp_path: Path) -> None:
    up = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    child = None
    try:
        tag = up_state.instance_tag(tmp_path, up.pid)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                 env={**os.environ, up_state.INSTANCE_ENV: tag})
        _wait_tagged(tmp_path, child.pid)
        assert not (tmp_path / up_state.PID_FILE).exists()
        with pytest.raises(up_state.AlreadyRunning, match=f"pid {up.pid}"):
            up_state.stop_leftovers(tmp_path, grace_s=1)
        assert child.poll() is None and up.poll() is None
    finally:
        for proc in (child, up):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_the_guardian_kills_what_ignores_the_parent_death_signal(tmp_path: Path) -> None:
    """A child stuck in its shutdown (here: one that ignores SIGTERM) is SIGKILLed once the pipe
    from ftq up closes and the grace period has passed; then the guardian exits."""
    tag = up_state.instance_tag(tmp_path)
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(300)"], env={**os.environ, up_state.INSTANCE_ENV: tag},
                             start_new_session=True)
    guardian, lifeline = up_state.start_guardian(tag, grace_s=1)
    try:
        _wait_tagged(tmp_path, stuck.pid)
        time.sleep(1.5)
        assert stuck.poll() is None and guardian.poll() is None, "the guardian acts only once ftq up is gone"
        os.close(lifeline)  # what the kernel does when ftq up dies
        assert stuck.wait(timeout=20) == -signal.SIGKILL
        assert guardian.wait(timeout=20) == 0
    finally:
        stuck.kill()
        stuck.wait()
        guardian.kill()
        guardian.wait()


def _wait_tagged(data_dir: Path, pid: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while pid not in up_state.tagged(f"{data_dir.resolve()}#"):
        assert time.monotonic() < deadline, f"pid {pid} never showed its tag"
        time.sleep(0.05)


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
