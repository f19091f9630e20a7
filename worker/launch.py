"""How a claimed job's processes start: the trainer itself for one GPU, torchrun for several;
the environment they get (``trainer_env``). The executors (worker/executors/) run these commands.

    1 GPU     <trainer_argv> run job.json                       (python -m trainer run job.json)
    N GPUs    <torchrun_argv> --standalone --nproc-per-node=N --log-dir=<dir> --tee=2
                  <trainer module or script> run job.json        (one rank per GPU)

A generation job's job.json (``kind: generate``) takes the trainer's ``generate`` subcommand in
place of ``run`` (``subcommand``), on one process or under torchrun alike.

    M machines  <torchrun_argv> --nnodes=M --node-rank=i --nproc-per-node=G --rdzv-backend=c10d
                  --rdzv-endpoint=<leader address>:<port> --rdzv-id=<job>-<attempt>
                  --rdzv-conf=is_host=<1 on the leader> --local-addr=<this machine's address> ...

``--standalone`` runs a local rendezvous on a free port, so several multi-GPU jobs of one host
never meet. ``CUDA_VISIBLE_DEVICES`` (``trainer_env``) holds the job's reserved
GPUs, so rank r uses the r-th of them. ``--log-dir`` keeps each rank's stderr in a file of its
own and ``--tee=2`` also copies it, prefixed ``[default<r>]:``, to torchrun's stderr, which the
worker keeps as ``trainer.stderr.log``. stdout is not redirected: rank 0's events reach the
worker through torchrun's stdout pipe (only rank 0 emits them).

Across machines (worker/nodes.py), c10d gives node ranks in the sorted order of the nodes'
``--local-addr``, so global rank 0 is on the machine whose address sorts first: the leader, which
hosts the rendezvous store (``is_host``, not guessed from host names) and alone reads events.

Every process of the run carries ``run_tag`` in its environment (worker/process.py), so the
worker can stop all of them, whatever session torchrun put them in.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from worker.runtime import WorkerOptions
from worker.tracking.resolve import without_credentials

if TYPE_CHECKING:
    from worker.runtime import Runtime

_SECRET_ENV = ("FTQ_DATABASE_URL", "FTQ_BROKER_URL", "FTQ_REDIS_URL", "FTQ_WORKER_KEY")
_PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where one machine's torchrun meets the others of a multi-machine job."""

    nodes: int
    node_rank: int
    endpoint: str
    """``<leader address>:<port>`` of the c10d rendezvous store (the leader hosts it)."""
    run_id: str
    """``<job id>-<attempt>``: attempts never meet each other."""
    local_addr: str
    """This machine's address (it orders the node ranks, and the process group's rank 0 is reached at it)."""

    def argv(self) -> list[str]:
        return [
            f"--nnodes={self.nodes}",
            f"--node-rank={self.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=is_host={1 if self.node_rank == 0 else 0}",
            f"--local-addr={self.local_addr}",
        ]


def trainer_argv(options: WorkerOptions, job_json: Path) -> list[str]:
    """The trainer itself on ``job_json`` (one process, one GPU)."""
    return [*options.trainer_argv, subcommand(job_json), str(job_json)]


def torchrun_argv(
    options: WorkerOptions, job_json: Path, *, ranks: int, rank_log_dir: Path, rendezvous: Rendezvous | None = None
) -> list[str]:
    """torchrun with ``ranks`` ranks of the trainer on ``job_json``: a rendezvous of this host
    alone (``--standalone``), or the multi-machine job's ``rendezvous``."""
    return [
        *options.torchrun_argv,
        *(rendezvous.argv() if rendezvous is not None else ["--standalone"]),
        f"--nproc-per-node={ranks}",
        f"--log-dir={rank_log_dir}",
        "--tee=2",
        *torchrun_entry(options.trainer_argv),
        subcommand(job_json),
        str(job_json),
    ]


def subcommand(job_json: Path) -> str:
    """``generate`` for a generation job's job.json, ``serve`` for a chat session's, ``eval`` for an eval
    run's, else ``run``; a file that is not there or not JSON is the trainer's to refuse (``run``, which
    ends with a config_error)."""
    from trainer.evals.config import is_eval_job
    from trainer.generate.job_config import is_generate_job
    from trainer.generate.session_config import is_session_job

    try:
        raw = json.loads(job_json.read_text())
    except (OSError, ValueError):
        return "run"
    if not isinstance(raw, dict):
        return "run"
    if is_session_job(raw):
        return "serve"
    return "generate" if is_generate_job(raw) else "eval" if is_eval_job(raw) else "run"


def torchrun_entry(trainer_argv: tuple[str, ...]) -> list[str]:
    """``trainer_argv`` as torchrun's entry point: what follows the Python interpreter
    (``-m trainer`` or a script), or the whole command after ``--no-python``."""
    first = Path(trainer_argv[0]).name
    if trainer_argv[0] == sys.executable or first.startswith("python"):
        return list(trainer_argv[1:])
    return ["--no-python", *trainer_argv]


def run_tag(worker_id: str, job_id: str, attempt: int) -> str:
    """The tag every process of one attempt of a job carries: ``<worker>|<job>|<attempt>``."""
    return f"{worker_host_tag(worker_id)}{job_id}|{attempt}"


def worker_host_tag(worker_id: str) -> str:
    """The prefix of the tags of every run this worker starts (to find leftovers at its start)."""
    return f"{worker_id}|"


def trainer_env(runtime: Runtime, devices: tuple[str | None, ...] | None = None) -> dict[str, str]:
    """The worker's environment without the service's connection URLs, pinned to ``devices``
    (a job's reserved GPUs; None: all of the host's) by ``CUDA_VISIBLE_DEVICES``. CPU slots
    leave it as the worker inherited it."""
    env = without_credentials({k: v for k, v in os.environ.items() if k not in _SECRET_ENV}, runtime.settings)
    env["PYTHONUNBUFFERED"] = "1"
    gpus = [d for d in (runtime.options.pool if devices is None else devices) if d is not None]
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if (_PROJECT_ROOT / "trainer").is_dir():
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{_PROJECT_ROOT}{os.pathsep}{path}" if path else str(_PROJECT_ROOT)
    return env
