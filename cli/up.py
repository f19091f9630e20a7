"""``ftq up``: the whole service on one machine, with one command.

With no ``FTQ_DATABASE_URL`` / ``FTQ_BROKER_URL`` set it needs no server: a SQLite store and
kombu's SQLAlchemy broker live under ``FTQ_DATA_DIR``. Order of start-up:

1. apply the store's migrations; on the first start (no users in the store) create the user
   ``admin``, print its API key once and save it to the client config file (``cli/users.py``);
2. if ``FTQ_MODEL_ROOT`` is empty, write a tiny random-weight demo model ``tiny-llama`` there
   (``python -m trainer make-tiny-model``), so a new user can submit a job at once
   (``--no-demo-model`` skips it);
3. start ``ftq api`` and one ``ftq worker`` (holding ``--gpus`` / ``--gpu`` / ``--slots`` as given,
   else CUDA_VISIBLE_DEVICES, else one CPU slot) as child processes, each in its own session so a
   Ctrl-C reaches only this supervisor. Once ``/healthz`` answers and the worker has reported its
   hardware (so the migrations' and Celery's start-up output, ~80 lines, is behind), print the URL
   and, last, a box (``welcome_box``): the dashboard and API docs URLs, the admin key on the first
   start (where it is saved, on later ones) and the line that puts ``ftq`` on PATH.

Ctrl-C, SIGTERM or SIGHUP (the terminal or SSH session closed) stops both: SIGTERM to each, the
worker hands a running job back to the queue after its trainer checkpointed; a child still
running after its grace period is killed, and so is any process of the instance left after them
(every one carries the instance's tag, ``cli/up_state.py``). If either child dies, the other is
stopped and ``ftq up`` exits non-zero. Killed outright (``kill -9`` of its process group
included), its children get SIGTERM (a parent-death signal) and a guardian process started first
SIGKILLs whatever of the instance is left after the grace period (an API held open by an event
stream, a trainer); a new ``ftq up`` stops whatever a dead one left before it starts its own
children (its pid file and the tag), so it never runs a second worker beside the old one and the
running job resumes as after Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cli import up_state
from core.settings import Settings

DEMO_MODEL = "tiny-llama"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""SIGHUP: the terminal or SSH session that ran ``ftq up`` closed."""
PROSE_WIDTH = 64
"""Where the box's sentences wrap; its URLs, key and commands never do."""


class Prose(str):
    """Box text that may be wrapped at ``PROSE_WIDTH``; a plain ``str`` row is printed whole."""


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("up", help="start the API and a local worker (embedded store by default)")
    parser.add_argument("--host", help="API bind address (default FTQ_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="API port (default FTQ_PORT or 8000)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--gpu", help="one GPU for the local worker (default: CUDA_VISIBLE_DEVICES, else CPU)")
    which.add_argument("--gpus", help="`all` or a list like 0,1,3: the GPUs the local worker holds as one pool")
    which.add_argument("--slots", type=int, help="a box without GPUs: CPU \"GPUs\" of the local worker (default 1)")
    parser.add_argument("--no-demo-model", action="store_true", help="do not seed an empty FTQ_MODEL_ROOT")
    parser.set_defaults(run=run_up)


def run_up(args: argparse.Namespace) -> int:
    from cli.db import redact, upgrade_store
    from cli.users import bootstrap_admin
    from core.db import utcnow

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides).resolved()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings.model_root.mkdir(parents=True, exist_ok=True)
    print(f"ftq: store {redact(settings.database_url or '')}, data in {settings.data_dir}", flush=True)
    grace_s = settings.cancel_grace_s + 30
    try:  # before the store is touched: the old instance's API and worker may still use it
        up_state.stop_leftovers(settings.data_dir, grace_s=grace_s)
    except up_state.AlreadyRunning as exc:
        print(f"ftq: {exc}", file=sys.stderr)
        return 1
    upgrade_store(settings)
    # First start only: an admin key, saved for the CLI now and shown once, in the box below.
    new_key = bootstrap_admin(settings, show_key=False)
    if not args.no_demo_model:
        seed_demo_model(settings.model_root)

    tag = up_state.instance_tag(settings.data_dir)
    env = {**child_env(settings), up_state.INSTANCE_ENV: tag}
    launched_at = utcnow()
    base = [sys.executable, "-m", "cli", "--log-level", args.log_level]
    worker_cmd = [*base, "worker", *worker_flags(args)]
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    guardian, lifeline = up_state.start_guardian(tag, grace_s)
    armed = up_state.die_with_parent()
    children = {
        "api": subprocess.Popen([*base, "api"], env=env, start_new_session=True, preexec_fn=armed),
        "worker": subprocess.Popen(worker_cmd, env=env, start_new_session=True, preexec_fn=armed),
    }
    up_state.record(settings.data_dir, {name: child.pid for name, child in children.items()}, settings.port,
                    guardian.pid)
    key_shown = False
    try:
        url = f"http://{_client_host(settings.host)}:{settings.port}"
        if _wait_healthy(url, children, stop) and _wait_worker_registered(settings, launched_at, children, stop):
            print(f"ftq is up: {url}  (API docs: {url}/docs; Ctrl-C stops)", flush=True)
            remember_url(url)
            print(welcome_box(url, new_key=new_key, **box_facts()), flush=True)
            key_shown = True
        exited = _supervise(children, stop)
    finally:
        _stop_all(children, worker_grace_s=grace_s)
        _end_instance(tag, guardian, lifeline)
        up_state.clear(settings.data_dir)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if new_key and not key_shown:  # the service never answered: the only showing is now
            from cli.users import print_new_key

            print_new_key("admin", new_key)
    if exited:
        print(f"ftq: {exited} exited unexpectedly (code {children[exited].returncode}); stopped the rest",
              file=sys.stderr)
        return 1
    return 0


def remember_url(url: str) -> None:
    """Save the URL for the client commands of any later shell (``cli/config.py``)."""
    from cli import config

    if config.remember_api_url(url) is None:
        print(f"ftq: warning: could not save {url} to {config.config_path()}; set FTQ_API_URL={url} "
              "in other shells", file=sys.stderr, flush=True)


def welcome_box(url: str, *, new_key: str | None, config_file: Path, saved_key: str | None,
                bin_dir: Path | None) -> str:
    """What ``ftq up`` prints last, once the service answers: where to go and with which key.

    Args:
        url: the API's base URL, as the client commands reach it.
        new_key: the admin key created at this start (the first), shown here once; None later.
        config_file: the client config file (``cli/config.py``).
        saved_key: the ``api_key`` that file holds now, if any (never printed: it only tells
            whether ``new_key`` was saved, and on later starts whether a key is there).
        bin_dir: the directory holding the ``ftq`` command, for the PATH line; None if unknown.

    Returns:
        The box, ASCII only, one line per row; URLs, the key and commands are never wrapped, so
        each can be copied whole.
    """
    rows: list[tuple[str, list[str | Prose]]] = [("Dashboard", [f"{url}/"]), ("API docs", [f"{url}/docs"])]
    if new_key:
        saved = (f"Saved to {config_file} for the ftq command; paste it into the dashboard's login."
                 if saved_key == new_key else
                 f"Not saved to {config_file}: save it with ftq login --key <the key>.")
        rows.append(("Admin key", [new_key, Prose(f"shown once: the store keeps only its hash. {saved}"),
                                   Prose("Add teammates with ftq users create NAME.")]))
    elif saved_key:
        rows.append(("API key", [Prose(f"saved in {config_file} for the ftq command."),
                                 Prose("Lost? A new admin key:"), "ftq users key admin"]))
    else:
        rows.append(("API key", [Prose(f"none saved in {config_file}."),
                                 Prose("A new admin key, then save it for the ftq command:"),
                                 "ftq users key admin", "ftq login --key <the key>"]))
    if bin_dir is not None:
        rows.append(("ftq on PATH", [f'export PATH="{bin_dir}:$PATH"',
                                     Prose("in another terminal: this one runs ftq until Ctrl-C.")]))
    label_width = max(len(label) for label, _ in rows) + 2
    lines = []
    for label, values in rows:
        texts = [line for value in values for line in
                 (_wrap(value) if isinstance(value, Prose) else [value])]
        lines.extend((label if i == 0 else "").ljust(label_width) + text for i, text in enumerate(texts))
    width = max(len(line) for line in lines)
    rule = "+" + "-" * (width + 2) + "+"
    return "\n".join([rule, *(f"| {line.ljust(width)} |" for line in lines), rule])


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, PROSE_WIDTH, break_long_words=False, break_on_hyphens=False)


def box_facts() -> dict[str, Any]:
    """The box's facts about this machine: the config file, its key, the ``ftq`` command's directory."""
    from cli import config
    from cli.errors import CliError

    path = config.config_path()
    try:
        saved_key = config.load_config(path).get("api_key") or None
    except CliError:
        saved_key = None
    return {"config_file": path, "saved_key": saved_key, "bin_dir": ftq_bin_dir()}


def ftq_bin_dir() -> Path | None:
    """The directory of the ``ftq`` command this interpreter installed (``.venv/bin`` after
    ``make up``), else the one on PATH, else None."""
    scripts = Path(sysconfig.get_path("scripts"))
    if (scripts / "ftq").is_file():
        return scripts
    found = shutil.which("ftq")
    return Path(found).parent if found else None


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The local worker's ``--gpu`` / ``--gpus`` / ``--slots``, as given to ``ftq up``."""
    for flag in ("gpu", "gpus", "slots"):
        value = getattr(args, flag, None)
        if value is not None:
            return [f"--{flag}", str(value)]
    return []


def seed_demo_model(model_root: Path) -> None:
    """Write the tiny demo model into an empty model root (a warning, not a failure, if it cannot)."""
    if any(model_root.iterdir()):
        return
    target = model_root / DEMO_MODEL
    print(f"ftq: {model_root} is empty; writing a tiny random-weight demo model to {target}", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "make-tiny-model", str(target), "--arch", "llama"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        print(f"ftq: warning: could not write the demo model (exit {done.returncode}):\n{tail}", file=sys.stderr)


def child_env(settings: Settings) -> dict[str, str]:
    """The environment for the children: the resolved settings, so both use the same store."""
    env = dict(os.environ)
    env.update(
        FTQ_DATA_DIR=str(settings.data_dir),
        FTQ_MODEL_ROOT=str(settings.model_root),
        FTQ_DATABASE_URL=settings.database_url or "",
        FTQ_BROKER_URL=settings.broker_url or "",
        FTQ_HOST=settings.host,
        FTQ_PORT=str(settings.port),
    )
    return env


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_healthy(url: str, children: dict[str, subprocess.Popen[bytes]], stop: threading.Event,
                  timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stop.is_set():
        if any(child.poll() is not None for child in children.values()):
            return False
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        stop.wait(0.3)
    return False


def _wait_worker_registered(settings: Settings, since: dt.datetime, children: dict[str, subprocess.Popen[bytes]],
                            stop: threading.Event, timeout_s: float = 120.0) -> bool:
    """Until the local worker has written its row with its hardware (its start-up output is then
    printed, so the box comes after it); False if a child died or a stop came first. After
    ``timeout_s`` (a slow hardware probe) True anyway: the worker registers later, jobs wait for it."""
    from sqlalchemy import select

    from core.db import make_engine
    from core.workers.models import Worker

    engine = make_engine(settings.database_url or "")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not stop.is_set():
            if any(child.poll() is not None for child in children.values()):
                return False
            with engine.connect() as connection:
                reported = connection.execute(select(Worker.hardware).where(Worker.started_at >= since)).scalars()
                if any(reported):
                    return True
            stop.wait(0.3)
    finally:
        engine.dispose()
    return not stop.is_set()


def _supervise(children: dict[str, subprocess.Popen[bytes]], stop: threading.Event) -> str | None:
    """Wait for a stop signal or a child's death; the name of a child that died, else None."""
    while not stop.wait(0.5):
        for name, child in children.items():
            if child.poll() is not None:
                return name
    return None


def _stop_all(children: dict[str, subprocess.Popen[bytes]], *, worker_grace_s: float) -> None:
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)  # the main process only: it shuts down its pool itself
    for name, child in children.items():
        try:
            child.wait(timeout=worker_grace_s if name == "worker" else 20)
        except subprocess.TimeoutExpired:
            print(f"ftq: {name} did not stop in time; killing it", file=sys.stderr)
            _signal(child, signal.SIGKILL)
            child.wait()


def _end_instance(tag: str, guardian: subprocess.Popen[bytes], lifeline: int) -> None:
    """After the children stopped: kill what of the instance outlived them (a trainer whose worker
    was killed), then let the guardian go (it finds nothing left)."""
    left = up_state.kill_tagged(tag)
    if left:
        print(f"ftq: processes of this instance survived SIGKILL: {left}", file=sys.stderr)
    os.close(lifeline)
    try:
        guardian.wait(timeout=up_state.KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        guardian.kill()
        guardian.wait()


def _signal(child: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
