"""``ftq api`` and ``ftq worker``: the production parts, one process each."""

from __future__ import annotations

import argparse
import os
from typing import Any

from core.settings import Settings


def add_api_parser(commands: Any) -> None:
    parser = commands.add_parser("api", help="serve the REST API (uvicorn)")
    parser.add_argument("--host", help="bind address (default FTQ_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default FTQ_PORT or 8000)")
    parser.set_defaults(run=run_api)


def add_worker_parser(commands: Any) -> None:
    parser = commands.add_parser("worker", help="run this host's job worker (one for all its GPUs)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--gpu",
        help="one GPU for this worker: an index or a GPU UUID (jobs get CUDA_VISIBLE_DEVICES set to it)",
    )
    which.add_argument(
        "--gpus",
        help="`all` or a list like 0,1,3: the GPUs this worker holds as one pool; a job of N GPUs "
        "runs on N of them (torchrun); `all` on a box without GPUs is one CPU slot",
    )
    which.add_argument(
        "--slots",
        type=int,
        help="a box without GPUs: how many CPU \"GPUs\" the pool offers (a job of N runs N ranks on the "
        "CPU with gloo); default 1",
    )
    parser.add_argument(
        "--name",
        help="worker id stored on its jobs and its GPUs (default <hostname>/gpu<ids> or <hostname>/cpu)",
    )
    parser.set_defaults(run=run_worker)


KEEP_ALIVE_S = 75
"""How long the API keeps an idle client connection open. uvicorn's default (5 s) equals httpx's
own idle expiry (5 s), so a client that pauses about 5 s between requests (a CLI step, a page
left open) could send on a connection the server was closing at that instant and get "Server
disconnected without sending a response". Longer than the clients' expiry, the client always
drops the connection first; longer than a proxy's usual 60 s idle timeout, the proxy does."""


SHUTDOWN_GRACE_S = 5
"""How long ``ftq api`` waits at SIGTERM for open requests before it cancels them. Event streams
(``GET /v1/jobs/{id}/events``) end only with their job, so without a bound an open dashboard
kept a stopped API alive until its job finished; a cancelled stream's client reconnects with
``Last-Event-ID`` to the next API and misses nothing."""


def api_server_config(app: Any, host: str, port: int, log_level: str = "info") -> Any:
    """The uvicorn configuration ``ftq api`` serves with (the tests' live servers use it too)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)


def run_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides).resolved()
    _pin(settings)
    uvicorn.Server(api_server_config(create_app(settings), settings.host, settings.port,
                                     args.log_level.lower())).run()
    return 0


def run_worker(args: argparse.Namespace) -> int:
    """One Celery worker in this process holding the GPUs (or CPU slots) the flags name."""
    from cli.errors import CliError
    from worker.app import create_worker_app, worker_argv
    from worker.runtime import WorkerOptions
    from worker.shared_storage import published

    gpus = worker_gpus(args)
    if args.slots is not None and args.slots < 1:
        raise CliError(f"--slots {args.slots}: give 1 or more")
    options = WorkerOptions(gpus=tuple(gpus), slots=args.slots or 1, name=args.name)
    settings = Settings().resolved()
    try:
        settings.check_remote_worker()
        published(settings)  # FTQ_SHARED_DIR mounted and writable, its marker read: refused now, not at a job
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    _pin(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    require_migrated_store(settings)
    app = create_worker_app(settings, options)
    app.worker_main(worker_argv(options, loglevel=args.log_level))
    return 0


def _pin(settings: Settings) -> None:
    """Apply ``FTQ_CPUS`` to this process (core/affinity.py)."""
    from cli.errors import CliError
    from core.affinity import pin_process

    try:
        pin_process(settings.cpus)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def worker_gpus(args: argparse.Namespace, env: dict[str, str] | None = None) -> list[str]:
    """The GPU ids of the worker's pool; empty for CPU slots.

    Raises:
        CliError: ``--gpu`` that is not one GPU id, or a bad ``--gpus`` list.
    """
    from cli.errors import CliError
    from cli.workers import GPU_ID, parse_gpus, visible_gpus

    if args.gpu is not None:
        if not GPU_ID.match(args.gpu):
            raise CliError(f"--gpu {args.gpu!r}: give one GPU index (e.g. 0) or UUID; for several use --gpus 0,1")
        return [args.gpu]
    if args.gpus is not None:
        found = [gpu for gpu in parse_gpus(args.gpus) if gpu is not None]
        if not found:
            print("ftq: no GPU found (CUDA_VISIBLE_DEVICES / nvidia-smi); holding one CPU slot", flush=True)
        return found
    env = dict(os.environ) if env is None else env
    if args.slots is None and env.get("CUDA_VISIBLE_DEVICES"):
        return visible_gpus(env)
    return []


def require_migrated_store(settings: Settings) -> None:
    """Refuse to start on a store without the schema, with the command that fixes it."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    from cli.db import redact
    from cli.errors import CliError
    from core.db import make_engine

    url = settings.database_url or ""
    engine = make_engine(url)
    try:
        has_jobs = inspect(engine).has_table("job")
    except SQLAlchemyError as exc:
        raise CliError(f"cannot reach the store at {redact(url)}: {exc}; check FTQ_DATABASE_URL") from exc
    finally:
        engine.dispose()
    if not has_jobs:
        raise CliError(f"the store at {redact(url)} has no schema; run `ftq db upgrade` first")
