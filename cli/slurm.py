"""``ftq slurm-bridge``: an ftq worker whose pool is a Slurm partition (docs/slurm.md).

It runs where ``sbatch`` works (a login node), with the store (or the API URL and a worker key)
as ``ftq worker`` has them, and submits each job placed on its pool as one Slurm job.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

from core.settings import Settings


def add_parsers(commands: Any) -> None:
    parser = commands.add_parser("slurm-bridge", help="submit the jobs of a Slurm pool (pool: slurm) to a partition")
    parser.add_argument("--partition", required=True, help="the Slurm partition every job goes to")
    parser.add_argument("--shared-dir", required=True, type=Path,
                        help="a directory every node mounts at the same path (job files, checkpoints; FTQ_DATA_DIR "
                        "must lie in it)")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="GPUs of each node a job may use (--gpus-per-node); 0: a cluster without GPUs (ranks on "
                        "CPU slots)")
    parser.add_argument("--slots-per-node", type=int, help="without GPUs: ranks per node (default: its CPUs)")
    parser.add_argument("--account", help="sbatch --account")
    parser.add_argument("--qos", help="sbatch --qos")
    parser.add_argument("--time", dest="time_limit", help="sbatch --time (e.g. 1-00:00:00)")
    parser.add_argument("--signal-s", type=int, default=120,
                        help="seconds before the time limit at which the trainer is asked to checkpoint (default 120)")
    parser.add_argument("--environment", default="",
                        help="shell lines run on the first node before srun (module load ...; source venv/bin/activate)")
    parser.add_argument("--container", help="an image for srun --container-image (pyxis)")
    parser.add_argument("--python", help="the Python with ftq's trainer on the nodes (default: this one)")
    parser.add_argument("--pool", default="slurm", help="the pool name jobs ask for (default slurm)")
    parser.add_argument("--name", help="worker id (default slurm-<partition>@<hostname>)")
    parser.add_argument("--slurm-bin", type=Path, help="the directory of sbatch, squeue, scontrol, sinfo, scancel")
    parser.add_argument("--poll-s", type=float, default=2.0, help="how often a job's Slurm state is read (default 2)")
    parser.set_defaults(run=run_bridge)


def run_bridge(args: argparse.Namespace) -> int:
    """Check the cluster, then serve the pool as a Celery worker (``ftq worker``'s process)."""
    from cli.errors import CliError
    from cli.serve import _pin, require_migrated_store
    from worker import executors
    from worker.app import create_worker_app, worker_argv
    from worker.executors.slurm import SlurmExecutor
    from worker.slurm import bridge
    from worker.slurm.commands import SlurmCli
    from worker.slurm.config import BridgeConfig

    try:
        config = BridgeConfig(
            partition=args.partition, shared_dir=args.shared_dir.expanduser().absolute(),
            gpus_per_node=args.gpus_per_node, slots_per_node=args.slots_per_node, account=args.account, qos=args.qos,
            time_limit=args.time_limit, signal_s=args.signal_s, environment=args.environment, container=args.container,
            pool=args.pool, poll_s=args.poll_s, **({"python": args.python} if args.python else {}),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    settings = Settings().resolved()
    try:
        settings.check_remote_worker()
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    _pin(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    cli = SlurmCli(args.slurm_bin)
    try:
        partition = bridge.check(config, cli, settings)
    except bridge.BridgeError as exc:
        raise CliError(f"slurm-bridge: {exc}") from exc
    require_migrated_store(settings)
    name = args.name or f"slurm-{config.partition}@{socket.gethostname()}"
    options = bridge.worker_options(config, cli, partition, name)
    bridge.cancel_leftovers(cli, name)
    executors.register("slurm", SlurmExecutor.bound(config, cli))
    print(f"ftq: Slurm bridge {name}: partition {partition.name} ({partition.nodes} nodes x "
          f"{bridge.per_node(config, partition)} {config.unit} slots), pool {config.pool!r}", flush=True)
    app = create_worker_app(settings, options)
    app.worker_main(worker_argv(options, loglevel=args.log_level))
    return 0
