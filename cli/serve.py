"""``ftq api`` and ``ftq worker``: the production parts, one process each."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from core.settings import Settings

_GPU = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")


def add_api_parser(commands: Any) -> None:
    parser = commands.add_parser("api", help="serve the REST API (uvicorn)")
    parser.add_argument("--host", help="bind address (default FTQ_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default FTQ_PORT or 8000)")
    parser.set_defaults(run=run_api)


def add_worker_parser(commands: Any) -> None:
    parser = commands.add_parser("worker", help="run job workers (one per GPU)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--gpu",
        help="the GPU this worker owns: an index or a GPU UUID; sets CUDA_VISIBLE_DEVICES for the "
        "trainer (default: inherit CUDA_VISIBLE_DEVICES, CPU when unset)",
    )
    which.add_argument(
        "--gpus",
        help="`all` or a list like 0,1,3: one worker per GPU, each pinned to its GPU, stopped together "
        "by Ctrl-C; `all` on a box without GPUs starts one CPU worker",
    )
    parser.add_argument(
        "--name",
        help="worker id stored on its jobs (default <hostname>/gpu<N> or <hostname>/cpu); with --gpus, "
        "a prefix: <name>/gpu<N>",
    )
    parser.set_defaults(run=run_worker)


def run_api(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides).resolved()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level.lower())
    return 0


def run_worker(args: argparse.Namespace) -> int:
    if getattr(args, "gpus", None) is not None:
        return run_workers(args)
    gpu = args.gpu if args.gpu is not None else os.environ.get("CUDA_VISIBLE_DEVICES") or None
    return run_one_worker(gpu, name=args.name, log_level=args.log_level)


def run_one_worker(gpu: str | None, *, name: str | None, log_level: str) -> int:
    """One Celery worker in this process, pinned to ``gpu`` (None: CPU or the inherited device)."""
    from cli.errors import CliError
    from worker.app import create_worker_app, worker_argv
    from worker.runtime import WorkerOptions

    if gpu is not None:
        if not _GPU.match(gpu):
            raise CliError(
                f"--gpu {gpu!r}: give one GPU index (e.g. 0) or UUID per worker; start one worker per GPU"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    settings = Settings().resolved()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    require_migrated_store(settings)
    options = WorkerOptions(gpu=gpu, name=name)
    app = create_worker_app(settings, options)
    app.worker_main(worker_argv(options, loglevel=log_level))
    return 0


def run_workers(args: argparse.Namespace) -> int:
    """``--gpus``: one worker per GPU; a single one runs in this process, several are supervised."""
    from cli.supervise import Supervisor
    from cli.workers import parse_gpus, worker_children

    gpus = parse_gpus(args.gpus)
    if len(gpus) == 1:
        gpu = gpus[0]
        label = f"gpu{gpu}" if gpu is not None else "cpu"
        if gpu is None:
            print("ftq: no GPU found (CUDA_VISIBLE_DEVICES / nvidia-smi); starting one CPU worker", flush=True)
        return run_one_worker(gpu, name=f"{args.name}/{label}" if args.name else None, log_level=args.log_level)
    settings = Settings().resolved()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    require_migrated_store(settings)
    children = worker_children(gpus, log_level=args.log_level, name=args.name)
    print(f"ftq: starting {len(children)} workers ({', '.join(c.name for c in children)}); Ctrl-C stops them",
          flush=True)
    return Supervisor(children, grace_s=settings.cancel_grace_s + 30).run()


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
