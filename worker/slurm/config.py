"""How the Slurm bridge submits: one frozen object, built from ``ftq slurm-bridge``'s flags."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")
"""A partition, account or QOS name (what sbatch accepts, without anything a shell would read)."""
TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclass(frozen=True)
class BridgeConfig:
    partition: str
    """The Slurm partition every job is submitted to."""
    shared_dir: Path
    """A directory every node of the partition sees at the same path: each attempt's job.json,
    batch script, events and stderr go to ``<shared_dir>/ftq-jobs/<job>/attempt-<n>/``; the
    bridge's data directory (FTQ_DATA_DIR: datasets, checkpoints) must lie inside it."""
    gpus_per_node: int = 0
    """GPUs of each node a job may use (``--gpus-per-node``); 0: a cluster without GPUs, whose jobs
    run their ranks on CPUs (``--cpus-per-task``, one rank per slot, gloo)."""
    slots_per_node: int | None = None
    """Without GPUs: ranks per node a job may ask for; None: the partition's CPUs per node."""
    account: str | None = None
    """``--account``."""
    qos: str | None = None
    """``--qos``."""
    time_limit: str | None = None
    """``--time`` (Slurm's format, e.g. ``1-00:00:00``); None: the partition's default."""
    signal_s: int = 120
    """``--signal=TERM@<signal_s>``: the trainer checkpoints this long before the time limit."""
    environment: str = ""
    """Shell lines run on the first node before ``srun`` (``module load cuda; source /opt/ftq/bin/activate``)."""
    container: str | None = None
    """An image for srun's ``--container-image`` (the pyxis plugin); None: the nodes' own environment."""
    python: str = sys.executable
    """The Python interpreter on the nodes that has ftq's trainer (torch, transformers, peft)."""
    pool: str = "slurm"
    """The pool name jobs ask for (``pool: slurm``)."""
    poll_s: float = 2.0
    """How often a running job's Slurm state is read."""

    def __post_init__(self) -> None:
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None and not NAME.match(value):
                raise ValueError(f"{name}: {value!r} is not a Slurm name (letters, digits, _ . + -)")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node: must be >= 0, got {self.gpus_per_node}")
        if self.slots_per_node is not None and self.slots_per_node < 1:
            raise ValueError(f"slots_per_node: must be >= 1, got {self.slots_per_node}")
        if self.time_limit is not None and not TIME.match(self.time_limit):
            raise ValueError(f"time_limit: {self.time_limit!r} is not a Slurm time ([D-]HH:MM:SS, or minutes)")
        if not 0 <= self.signal_s <= 65535:
            raise ValueError(f"signal_s: must be between 0 and 65535, got {self.signal_s}")
        if "\n" in (self.container or "") or "'" in (self.container or ""):
            raise ValueError("container: give one image name, without quotes or newlines")
        if not self.shared_dir.is_absolute():
            raise ValueError(f"shared_dir: {self.shared_dir} must be an absolute path (every node resolves it alike)")
        if re.search(r"[\s%]", str(self.shared_dir)):
            # it is written unquoted into #SBATCH --chdir/--output/--error, where sbatch splits at
            # whitespace and reads % as a filename pattern (%j, %u, ...)
            raise ValueError(f"shared_dir: {str(self.shared_dir)!r} has whitespace or '%', which #SBATCH lines cannot "
                             "carry; mount or link it at a path without them")

    @property
    def unit(self) -> str:
        """What a job's ``gpus`` counts on this partition: ``gpu``, or ``cpu`` (ranks on CPU slots)."""
        return "gpu" if self.gpus_per_node else "cpu"

    def job_dir(self, job_id: str, attempt: int) -> Path:
        return self.shared_dir / "ftq-jobs" / job_id / f"attempt-{attempt}"

    def checkpoint_dir(self, job_id: str) -> Path:
        """The job's shared checkpoint directory (the trainer's ``shared_checkpoint_dir``):
        ``<shared>/jobs/<job>``, the layout ftq's own shared storage uses, so an API host that
        mounts the directory (``FTQ_SHARED_DIR``) serves its checkpoints."""
        from core.jobs.artifact_store import shared_job_dir

        return shared_job_dir(self.shared_dir, job_id)
