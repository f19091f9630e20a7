"""The bridge's start: check what it was given against the cluster, publish the partition's
limits, and build the worker options of the host that stands for the partition.

The bridge is an ftq worker (the same Celery worker, claim path, recorder and reaper as any
host) whose pool is the partition: ``nodes x per_node`` slots, ``worker.pool`` set to the pool's
name, and the ``slurm`` executor for every job. ftq's queue (priorities, caps, quotas) decides
which job goes to Slurm next; Slurm decides when and on which nodes it runs.

Refused at start, with what to fix (``BridgeError``): ``sbatch`` missing, a partition Slurm does
not have or that is not up, more GPUs (or CPU slots) per node than its nodes have, a shared
directory that is missing or not writable, a data directory outside it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from core.db import utcnow
from core.settings import Settings
from core.workers.pools import POOL_KEY
from worker.executors.slurm import bridge_comment
from worker.runtime import WorkerOptions
from worker.slurm.commands import Partition, SlurmCli, SlurmError
from worker.slurm.config import BridgeConfig
from worker.slurm.script import job_name

log = logging.getLogger(__name__)


class BridgeError(RuntimeError):
    """The bridge cannot serve its partition as configured; the message says what to change."""


def check(config: BridgeConfig, cli: SlurmCli, settings: Settings) -> Partition:
    """The partition, once everything the bridge needs is there.

    Raises:
        BridgeError: see the module docstring.
    """
    if cli.which("sbatch") is None:
        where = f"in {cli.bin_dir}" if cli.bin_dir else "on PATH"
        raise BridgeError(f"sbatch is not {where}: run the Slurm bridge on a host where Slurm's client commands "
                          "work (a login node), or name their directory with --slurm-bin")
    try:
        partition = cli.partition(config.partition)
        if partition is None:
            names = sorted({p.rstrip("*") for p in cli.run("sinfo", "-h", "-o", "%P").stdout.split()})
            raise BridgeError(f"partition {config.partition!r} does not exist in this Slurm cluster (its partitions: "
                              f"{', '.join(names) or 'none'}); give one of them with --partition")
    except SlurmError as exc:
        raise BridgeError(f"cannot ask Slurm about partition {config.partition!r}: {exc}") from exc
    if not partition.available:
        raise BridgeError(f"partition {config.partition!r} is not up (sinfo's availability); jobs would wait forever")
    if config.gpus_per_node > partition.gpus_per_node:
        raise BridgeError(f"--gpus-per-node {config.gpus_per_node}: the nodes of partition {config.partition!r} have "
                          f"{partition.gpus_per_node} GPU{'s' if partition.gpus_per_node != 1 else ''} (gres) each")
    if not config.gpus_per_node and (config.slots_per_node or 0) > partition.cpus_per_node:
        raise BridgeError(f"--slots-per-node {config.slots_per_node}: the nodes of partition {config.partition!r} "
                          f"have {partition.cpus_per_node} CPUs each")
    _check_dirs(config, settings)
    return partition


def _check_dirs(config: BridgeConfig, settings: Settings) -> None:
    shared = config.shared_dir
    if not shared.is_dir() or not os.access(shared, os.W_OK | os.X_OK):
        raise BridgeError(f"--shared-dir {shared}: not a directory this bridge can write; give the cluster's shared "
                          "directory (mounted at the same path on every node)")
    data = Path(settings.data_dir).resolve()
    if not data.is_relative_to(shared.resolve()):
        raise BridgeError(f"FTQ_DATA_DIR {data} is outside --shared-dir {shared}: the nodes read datasets and write "
                          "checkpoints there, so it must lie in the shared directory (e.g. "
                          f"FTQ_DATA_DIR={shared / 'ftq-data'})")
    if any(c.isspace() or c == "%" for c in str(data)):
        raise BridgeError(f"FTQ_DATA_DIR {data}: a path with whitespace or '%', which the batch script's #SBATCH "
                          "--chdir line cannot carry; use a path without them")


def per_node(config: BridgeConfig, partition: Partition) -> int:
    """Slots each node gives a job: its GPUs, or (no GPUs) CPU slots."""
    return config.gpus_per_node or config.slots_per_node or partition.cpus_per_node


def limits(config: BridgeConfig, partition: Partition) -> dict[str, Any]:
    """The partition's shape as ``core.workers.pools`` reads it."""
    return {"kind": "slurm", "name": config.pool, "partition": partition.name, "nodes": partition.nodes,
            "per_node": per_node(config, partition), "unit": config.unit, "account": config.account,
            "qos": config.qos, "time_limit": config.time_limit}


REPORT_EVERY_S = 5.0
"""Slurm is asked (sinfo, squeue) at most this often, however fast the heartbeat."""


def reporter(config: BridgeConfig, cli: SlurmCli, partition: Partition, worker_id: str) -> Callable[[], dict[str, Any]]:
    """What the bridge stores as its hardware at each heartbeat: the limits and Slurm's view (at
    most ``REPORT_EVERY_S`` old)."""
    shape = limits(config, partition)
    prefix = job_name("")
    last: list[tuple[float, dict[str, Any]]] = []

    def report() -> dict[str, Any]:
        if last and time.monotonic() - last[0][0] < REPORT_EVERY_S:
            return last[0][1]
        fresh = ask()
        last[:] = [(time.monotonic(), fresh)]
        return fresh

    def ask() -> dict[str, Any]:
        use = cli.node_use(partition.name)
        jobs = [{**job, "job_id": job["name"][len(prefix):] if job["name"].startswith(prefix) else None}
                for job in cli.jobs(bridge_comment(worker_id))]
        cluster = {"nodes": use.nodes, "cpus": use.cpus, "gpus": use.gpus, "jobs": jobs}
        return {POOL_KEY: {**shape, "cluster": cluster, "observed_at": utcnow().isoformat()}}

    return report


def worker_options(config: BridgeConfig, cli: SlurmCli, partition: Partition, name: str) -> WorkerOptions:
    """The host standing for the partition: a slot per GPU (or CPU slot) of every node."""
    slots = partition.nodes * per_node(config, partition)
    return WorkerOptions(slots=min(slots, 1024), name=name, executor="slurm", pool_name=config.pool,
                         report=reporter(config, cli, partition, name))


def cancel_leftovers(cli: SlurmCli, worker_id: str) -> list[str]:
    """``scancel`` the Slurm jobs an earlier run of this bridge left (its ftq jobs are retried or
    failed by the reaper, as a lost worker's are); their ids."""
    found = [job["slurm_job_id"] for job in cli.jobs(bridge_comment(worker_id))]
    for slurm_job_id in found:
        cli.cancel(slurm_job_id)
    if found:
        log.warning("cancelled %d Slurm jobs left by an earlier run of bridge %s: %s", len(found), worker_id, found)
    return found
