"""The executor seam: what runs a claimed job's trainer, behind one protocol.

The runner (worker/runner.py) claims a job, picks its executor by name (``choose`` in
worker/executors/__init__.py) and drives it through one lifecycle; only the executor knows which
processes, machines or scheduler carry the run:

    reserve   (class) in the claim's transaction: what the placement needs besides its GPUs,
              e.g. a multi-machine job's parts and rendezvous (``Claim.rendezvous``); None for most
    announce  (class) after the claim's commit: tell whoever else takes part (the followers)
    start     start the trainer on job.json; each event it prints goes to ``on_event``
    watch     whether the run goes on (the runner polls it between its event flushes)
    signal    ``Signal.stop``: checkpoint at the next step boundary and exit (a cancel, a worker
              shutdown); ``Signal.kill``: end every process of the run now, no checkpoint (a lost
              claim, a stop whose ``cancel_grace_s`` ran out)
    collect   once the run ended, or to end it at once: kill what is left, reap, clean up; how
              it exited (``TrainerExit``, which worker/outcome.py turns into the job's state)
    settle    the executor's last word on that state (a lost machine makes a failure a retry)

The runner calls ``collect`` exactly once, whatever happened, after ``start`` or after ``start``
raised. ``Executor`` is a ``Protocol``; subclass it to inherit the defaults of ``reserve``,
``announce`` and ``settle``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from sqlalchemy.orm import Session

    from core.jobs.placement import Placement
    from core.settings import Settings
    from worker.claim import Claim
    from worker.launch import Rendezvous
    from worker.outcome import Outcome
    from worker.process import TrainerExit
    from worker.runtime import Runtime

OnEvent = Callable[[dict[str, Any]], None]
"""Receives each event the trainer emits (rank 0's stdout lines, parsed), from a reader thread."""


class Signal(enum.Enum):
    """What the runner asks of a running trainer."""

    stop = "stop"
    """Checkpoint at the next step boundary and exit (SIGTERM to every rank)."""
    kill = "kill"
    """End every process of the run at once, without a checkpoint (SIGKILL to all of them)."""


class Executor(Protocol):
    """Runs one claimed job's trainer; built as ``executor_class(runtime, claim)``."""

    def __init__(self, runtime: Runtime, claim: Claim) -> None: ...

    @classmethod
    def reserve(cls, session: Session, settings: Settings, placement: Placement, attempt: int) -> Rendezvous | None:
        """In the claim's transaction: record what the placement needs besides its GPUs."""
        return None

    @classmethod
    def announce(cls, runtime: Runtime, job_id: str, attempt: int) -> None:
        """After the claim's commit: start whatever else takes part in the run."""

    @classmethod
    def shared_home(cls, job_id: str) -> Path | None:
        """Where every rank of the job writes its checkpoints when the executor's machines share a
        directory of their own (a Slurm cluster's); None: the claim decides (worker/shared_storage.py)."""
        return None

    def start(self, job_json: Path, on_event: OnEvent) -> None:
        """Start the trainer on ``job_json``; returns once it runs.

        Raises:
            OSError: the trainer could not be started (the job fails with the worker's error).
        """
        ...

    def watch(self) -> bool:
        """Whether the run goes on (False once every process the runner waits for has ended,
        or when it never started)."""
        ...

    def signal(self, signal: Signal) -> bool:
        """Deliver ``signal`` to the run; whether anything was left to receive it."""
        ...

    def collect(self) -> TrainerExit:
        """Kill whatever is left of the run, reap it, drain its output and clean up; its exit
        (returncode -1 when it never started)."""
        ...

    def settle(self, outcome: Outcome, *, max_attempts: int) -> Outcome:
        """``outcome`` as this executor sees it (the default keeps it)."""
        return outcome
