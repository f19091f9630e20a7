"""``slurm``: one Slurm job per attempt, submitted by the bridge (worker/slurm/, docs/slurm.md).

    start     job.json (and, where the trainer knows the key, ``shared_checkpoint_dir``) and the
              batch script go to ``<shared>/ftq-jobs/<job>/attempt-<n>/``; ``sbatch`` submits it
    watch     tails the script's stdout there (the trainer's events, as the local executor reads
              its pipe) and reads the job's state every ``poll_s``; each new state or pending
              reason becomes a ``log`` event on the job page ("Slurm job 12: PENDING (Resources)")
    signal    stop: ``scancel --signal=TERM`` to the job's steps (every rank checkpoints and
              exits), sent once the trainer's first event is read (below); a job still pending
              is cancelled outright. kill: ``scancel``. torchrun, which the TERM reaches too,
              waits for its ranks longer than ``max(cancel_grace_s, signal_s)`` (script.py)
    collect   cancels what still runs, waits for Slurm to end it, reads the last events; the
              batch script's exit code and the tail of its stderr
    settle    a node failure, a preemption, a time limit or Slurm's own TERM: a retry from the
              last checkpoint; a job Slurm would never start (a pending reason of states.NEVER,
              cancelled at once), one that ended before its trainer ran, or one whose
              ``--environment`` failed: failed, saying so (worker/slurm/states.py)

A stop that comes while the job runs but before its trainer printed an event waits for that
event: Slurm passes ``--signal`` only to the job's steps, so a TERM sent while the batch script
still runs ``--environment`` (no step yet) is dropped and the trainer would train on until the
kill ``cancel_grace_s`` later, without a checkpoint; and a TERM to a trainer still importing,
before its handler is in place, ends it without one. Rank 0 prints its first event after it put
its handler in place, and on several ranks after every rank joined the process group, each with
its handler; from then on the TERM makes every rank stop at a step boundary and checkpoint.

The bridge (worker/slurm/bridge.py) binds its ``BridgeConfig`` and ``SlurmCli`` to a subclass
(``bound``) and registers it as ``slurm`` for every job of its host.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import select

from core.jobs.models import Job
from trainer.events import parse_line
from worker.executors.base import Executor, OnEvent, Signal
from worker.launch import subcommand, trainer_env
from worker.process import TrainerExit
from worker.slurm import states
from worker.slurm.commands import JobState, SlurmCli, SlurmError
from worker.slurm.config import BridgeConfig
from worker.slurm.script import ENV_FAILED, EVENTS, SCRIPT, STDERR, Attempt, batch_script

if TYPE_CHECKING:
    from worker.claim import Claim
    from worker.outcome import Outcome
    from worker.runtime import Runtime

log = logging.getLogger(__name__)

MAX_POLL_FAILURES = 30
"""Slurm state reads failing in a row before the run is given up (the worker's error)."""
END_WAIT_S = 120.0
"""How long ``collect`` waits for Slurm to end a cancelled job."""


def bridge_comment(worker_id: str) -> str:
    """The ``--comment`` that marks the bridge's jobs (its leftovers are found by it)."""
    return f"ftq:{worker_id}"


class SlurmExecutor(Executor):
    """One Slurm job per attempt; subclass with ``bound`` to give it the bridge's configuration."""

    config: ClassVar[BridgeConfig]
    cli: ClassVar[SlurmCli]

    @classmethod
    def bound(cls, config: BridgeConfig, cli: SlurmCli) -> type[SlurmExecutor]:
        return type("BoundSlurmExecutor", (cls,), {"config": config, "cli": cli})

    def __init__(self, runtime: Runtime, claim: Claim) -> None:
        self.runtime = runtime
        self.claim = claim
        self.dir = self.config.job_dir(claim.job_id, claim.attempt)
        self.slurm_job_id: str | None = None
        self.state: JobState | None = None
        self.ran = False
        """Slurm reported the job running (or ended after it ran)."""
        self.refused: str | None = None
        """The pending reason the job was cancelled for: Slurm would never start it (states.NEVER)."""
        self._on_event: OnEvent | None = None
        self._offset = 0
        self._partial = b""
        self._polled = 0.0
        self._failures = 0
        self._lock = threading.Lock()
        self._trainer_seen = False
        """An event of the trainer was read: its ranks turn TERM into a checkpoint and a stop."""
        self._stop_pending: str | None = None
        """A stop asked for before that (``waiting``: not logged yet; ``logged``), sent once it is true."""

    @classmethod
    def shared_home(cls, job_id: str) -> Path | None:
        """The job's checkpoint directory in the cluster's shared directory: the claim's
        ``shared_home``, so a bridge with a worker key records checkpoints there instead of
        uploading ``output_dir``'s (which the trainer never writes)."""
        return cls.config.checkpoint_dir(job_id)

    def start(self, job_json: Path, on_event: OnEvent) -> None:
        self._on_event = on_event
        with self.runtime.sessionmaker() as session:
            nodes = session.execute(select(Job.nodes).where(Job.job_id == self.claim.job_id)).scalar_one() or 1
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in (EVENTS, STDERR):
            (self.dir / name).unlink(missing_ok=True)  # a redelivered attempt starts over
        shared_json = self.dir / "job.json"
        shared_json.write_text(json.dumps(self._job_config(job_json), indent=2))
        grace = math.ceil(max(self.runtime.settings.cancel_grace_s, self.config.signal_s))
        attempt = Attempt(self.claim.job_id, self.claim.attempt, nodes, self.claim.gpus // nodes, shared_json,
                          self.claim.output_dir, bridge_comment(self.runtime.worker_id), subcommand(job_json),
                          stop_grace_s=grace)
        script = self.dir / SCRIPT
        script.write_text(batch_script(self.config, attempt))
        self.slurm_job_id = self.cli.submit(script, env=trainer_env(self.runtime))
        self._log(f"submitted to Slurm as job {self.slurm_job_id} (partition {self.config.partition}, {nodes} "
                  f"node{'s' if nodes != 1 else ''} x {attempt.per_node} {self.config.unit} slot"
                  f"{'s' if attempt.per_node != 1 else ''}; files in {self.dir})")

    def _job_config(self, job_json: Path) -> dict[str, Any]:
        """The claim's job.json, with the shared checkpoint directory where the trainer reads one."""
        raw = json.loads(job_json.read_text())
        if subcommand(job_json) == "run" and _trainer_reads_shared_dir():
            raw["shared_checkpoint_dir"] = str(self.config.checkpoint_dir(self.claim.job_id))
        return raw

    def watch(self) -> bool:
        self._read_events()
        if self.slurm_job_id is None:
            return False
        self._pass_stop()
        if self.state is not None and time.monotonic() - self._polled < self.config.poll_s:
            return states.phase(self.state.state) != "ended"
        self._poll()
        assert self.state is not None
        if states.phase(self.state.state) == "ended":
            self._read_events()
            return False
        return True

    def _poll(self) -> None:
        assert self.slurm_job_id is not None
        self._polled = time.monotonic()
        try:
            state = self.cli.state(self.slurm_job_id)
        except SlurmError as exc:
            self._failures += 1
            if self._failures >= MAX_POLL_FAILURES:
                raise
            log.warning("job %s: cannot read Slurm job %s's state (%d): %s", self.claim.job_id, self.slurm_job_id,
                        self._failures, exc)
            state = self.state or JobState("PENDING", "ftq: state unknown yet")
        else:
            self._failures = 0
        previous, self.state = self.state, state
        if states.phase(state.state) == "running" or (states.phase(state.state) == "ended" and state.state != "CANCELLED"):
            self.ran = True
        if previous is None or (previous.state, previous.reason) != (state.state, state.reason):
            reason = "" if state.reason in ("None", "") else f" ({state.reason})"
            self._log(f"Slurm job {self.slurm_job_id}: {state.state}{reason}", slurm_state=state.state,
                      slurm_reason=state.reason)
        if states.phase(state.state) == "waiting" and state.reason in states.NEVER and self.refused is None:
            self.refused = state.reason
            self.cli.cancel(self.slurm_job_id)

    def _read_events(self) -> None:
        path = self.dir / EVENTS
        try:
            with path.open("rb") as stream:
                stream.seek(self._offset)
                chunk = stream.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for raw in lines:
            event = parse_line(raw)
            self._trainer_seen = self._trainer_seen or event is not None
            if event is not None and self._on_event is not None:
                try:
                    self._on_event(event)
                except Exception:  # noqa: BLE001 - a bad event must not stop the reading
                    log.exception("job %s: could not handle trainer event %r", self.claim.job_id, event.get("type"))

    def _log(self, message: str, **extra: Any) -> None:
        if self._on_event is not None:
            self._on_event({"type": "log", "level": "info", "source": "slurm", "message": message,
                            "slurm_job_id": self.slurm_job_id, **extra})

    def signal(self, signal: Signal) -> bool:
        if self.slurm_job_id is None:
            return False
        with self._lock:
            waiting = self.state is None or states.phase(self.state.state) == "waiting"
            if signal is Signal.stop and not waiting:
                if not self._trainer_seen:
                    self._stop_pending = self._stop_pending or "waiting"  # watch() sends it (module docstring)
                    return True
                return self.cli.cancel(self.slurm_job_id, signal="TERM")
            self._stop_pending = None
            return self.cli.cancel(self.slurm_job_id)

    def _pass_stop(self) -> None:
        """Send the TERM a stop asked for before the trainer's first event, once that is read."""
        with self._lock:
            pending, send = self._stop_pending, self._stop_pending is not None and self._trainer_seen
            self._stop_pending = None if send else pending and "logged"
        if pending == "waiting" and not send:
            self._log(f"stop asked before the trainer of Slurm job {self.slurm_job_id} started: its TERM waits for "
                      "the trainer's first event (Slurm would drop a TERM sent before the job's srun step, and a "
                      "trainer still importing would end without a checkpoint)")
        if send:
            assert self.slurm_job_id is not None
            self.cli.cancel(self.slurm_job_id, signal="TERM")

    def collect(self) -> TrainerExit:
        tail = self._stderr_tail()
        if self.slurm_job_id is None:
            return TrainerExit(returncode=-1, stderr_tail=tail, world_size=self.claim.gpus)
        if self.state is None or states.phase(self.state.state) != "ended":
            self.cli.cancel(self.slurm_job_id)
            deadline = time.monotonic() + END_WAIT_S
            while time.monotonic() < deadline:
                self._poll()
                if states.phase(self.state.state) == "ended":  # type: ignore[union-attr]
                    break
                time.sleep(min(1.0, self.config.poll_s))
        self._read_events()
        assert self.state is not None
        ran = self.ran or self._offset > 0
        return states.trainer_exit(self.state, self._stderr_tail(), self.claim.gpus, started=ran)

    def _stderr_tail(self) -> tuple[str, ...]:
        lines = self.runtime.options.stderr_tail_lines
        try:
            text = (self.dir / STDERR).read_text(errors="replace")
        except OSError:
            return ()
        return tuple(text.splitlines()[-lines:]) if lines else ()

    def settle(self, outcome: Outcome, *, max_attempts: int) -> Outcome:
        return states.settle(outcome, self.state, self.slurm_job_id, attempt=self.claim.attempt,
                             max_attempts=max_attempts, ran=self.ran or self._offset > 0, refused=self.refused,
                             environment_failed=self._environment_failed())

    def _environment_failed(self) -> str | None:
        """The batch script's line saying its ``--environment`` failed (script.ENV_FAILED), if any."""
        try:
            with (self.dir / STDERR).open(errors="replace") as stream:
                return next((line.strip() for line in stream if line.startswith(ENV_FAILED)), None)
        except OSError:
            return None


def _trainer_reads_shared_dir() -> bool:
    """Whether this trainer's config has ``shared_checkpoint_dir`` (checkpoints every rank writes
    to the cluster's shared directory); an older trainer refuses unknown keys."""
    from trainer.config import TrainConfig

    return any(f.name == "shared_checkpoint_dir" for f in fields(TrainConfig))
