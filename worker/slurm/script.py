"""The batch script of one attempt of a job: ``#SBATCH`` options, then one ``srun`` step that
starts the trainer on every node.

    1 node, 1 rank    srun <python> -m trainer run job.json            (as the local executor)
    M nodes x N ranks srun --nodes=M --ntasks-per-node=1: on each node one torchrun with N ranks,
                      c10d rendezvous at the first node's address (``scontrol show node``: its
                      NodeAddr) on a port free there, is_host on node 0 only (several nodes may
                      share one address, as the test cluster's do)

The script's stdout (``--output``) is the events file: the trainer's rank 0 prints one JSON event
per line, which the bridge tails. Its stderr (``--error``) keeps srun's, torchrun's and every
rank's stderr (``--tee=2``), whose tail a failed job's message ends with. ``--signal=TERM@S``
asks every rank to checkpoint S seconds before the time limit; ``--no-requeue``: a node failure or
preemption ends this attempt and ftq queues the next one itself, resuming from the last
checkpoint (docs/slurm.md says why). The script exits with srun's status.

A TERM to the step (``scancel --signal=TERM``, ``--signal``, a preemption) reaches every process
of it, torchrun too, which forwards it to its ranks and SIGKILLs them ``shutdown_timeout`` later:
30 s by default, too short for a large model's checkpoint. The script exports
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (torchrun's ``--shutdown-timeout``; a torch without the option
ignores it) as the attempt's stop grace plus ``SHUTDOWN_MARGIN_S``, so the kill that ends ranks
still checkpointing is ftq's (``scancel`` after ``cancel_grace_s``) or Slurm's (its time limit,
``KillWait``), never torchrun's.

The bridge's ``--environment`` runs before the launch as its user wrote it: without ``set -u`` or
``set -e``, which sites' profile scripts, ``module``, venv and conda activation are not written for
(they read unset variables and run tests that fail). A command of it that fails at the script's
top level (``source`` of a missing file, ``module load`` of an unknown module) ends the job there
with its status and an ``ENV_FAILED`` line naming it on stderr (an ERR trap, which ``if``
conditions and ``cmd || true`` do not set off), instead of starting the trainer in the wrong
environment; the executor then fails the job ``slurm_environment``. Then ``set -u`` for the launch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from worker.slurm.config import BridgeConfig

EVENTS = "events.jsonl"
STDERR = "stderr.log"
SCRIPT = "job.sbatch"
LAUNCH = "# the trainer"
ENV_FAILED = "ftq: the Slurm bridge's --environment failed"
"""How the batch script's stderr line begins when a command of ``--environment`` failed."""
ENV_TRAP = (
    # a failure inside a sourced file or a function (BASH_SOURCE deeper than the script) is that
    # file's own business; what counts is the command at the script's top level
    'ftq_status=$?; if [ "${#BASH_SOURCE[@]}" -le 1 ]; then '
    f'echo "{ENV_FAILED}: \\`$(sed -n "${{LINENO}}p" "$0" 2>/dev/null)\\` (line $LINENO of the batch script) exited '
    "with status $ftq_status; fix the bridge's --environment, or end a line whose failure is harmless with "
    "'|| true'\" >&2; exit $ftq_status; fi"
)
SHUTDOWN_MARGIN_S = 60
"""torchrun waits this much longer than the stop grace before it SIGKILLs ranks that got a TERM:
past ftq's ``scancel`` and Slurm's ``KillWait`` after it (30 s by default)."""


@dataclass(frozen=True)
class Attempt:
    """What one attempt of one job asks of Slurm."""

    job_id: str
    attempt: int
    nodes: int
    per_node: int
    """GPUs (a CPU cluster: ranks on CPU slots) on each node."""
    job_json: Path
    workdir: Path
    """The trainer's working directory (the job's output directory)."""
    comment: str
    """``--comment``: tags the job as this bridge's (``ftq:<worker id>``)."""
    subcommand: str = "run"
    stop_grace_s: int = 0
    """How long a stop lets the ranks checkpoint before ftq or Slurm kills them (the executor's
    ``max(cancel_grace_s, signal_s)``): torchrun waits longer (``SHUTDOWN_MARGIN_S``)."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


def job_name(job_id: str) -> str:
    return f"ftq-{job_id}"


def batch_script(config: BridgeConfig, attempt: Attempt) -> str:
    """The whole script, ``#!/bin/bash`` first."""
    out = config.job_dir(attempt.job_id, attempt.attempt)
    options = [
        f"--job-name={job_name(attempt.job_id)}",
        f"--comment={attempt.comment}",
        f"--partition={config.partition}",
        *([f"--account={config.account}"] if config.account else []),
        *([f"--qos={config.qos}"] if config.qos else []),
        f"--nodes={attempt.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={attempt.per_node}"] if config.gpus_per_node else [f"--cpus-per-task={attempt.per_node}"]),
        *([f"--time={config.time_limit}"] if config.time_limit else []),
        *([f"--signal=TERM@{config.signal_s}"] if config.signal_s else []),
        "--no-requeue",
        f"--chdir={attempt.workdir}",
        f"--output={out / EVENTS}",
        f"--error={out / STDERR}",
    ]
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options), "",
             f"# ftq job {attempt.job_id}, attempt {attempt.attempt}: written by the Slurm bridge (docs/slurm.md)",
             "export PYTHONUNBUFFERED=1"]
    if config.environment.strip():
        lines += ["", "# the bridge's --environment, as written: no set -u or set -e (sites' profile scripts read",
                  "# unset variables and run failing tests); a command of it that fails ends the job, naming it",
                  f"trap {shlex.quote(ENV_TRAP)} ERR", config.environment.strip(), "trap - ERR"]
    lines += ["", LAUNCH, "set -u", *_launch(config, attempt), "exit $?", ""]
    return "\n".join(lines)


def _launch(config: BridgeConfig, attempt: Attempt) -> list[str]:
    q = shlex.quote
    container = [f"--container-image={q(config.container)}"] if config.container else []
    trainer = ["-m", "trainer", attempt.subcommand, q(str(attempt.job_json))]
    if attempt.ranks == 1:
        return [" ".join(["srun", "--nodes=1", "--ntasks=1", *container, q(config.python), *trainer])]
    torchrun = " ".join([
        q(config.python), "-m", "torch.distributed.run", f"--nnodes={attempt.nodes}",
        f"--nproc-per-node={attempt.per_node}", "--rdzv-backend=c10d", '--rdzv-endpoint="$FTQ_RDZV"',
        f"--rdzv-id=ftq-{attempt.job_id}-{attempt.attempt}", '--rdzv-conf=is_host=$((SLURM_NODEID == 0 ? 1 : 0))',
        "--tee=2", *trainer,
    ])
    return [
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'addr=$(scontrol show node "$head" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
        f"port=$({q(config.python)} -c 'import socket; s = socket.socket(); s.bind((\"\", 0)); print(s.getsockname()[1])')",
        'export FTQ_RDZV="${addr:-$head}:$port"',
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={attempt.stop_grace_s + SHUTDOWN_MARGIN_S}",
        " ".join(["srun", f"--nodes={attempt.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *container,
                  "bash", "-c", q(f"exec {torchrun}")]),
    ]
