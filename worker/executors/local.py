"""``local``: the trainer itself, one process on the job's one GPU (or CPU slot) of this host.

The process runs in a session of its own with the job's run tag in its environment
(worker/process.py ``TrainerProcess``), pinned by ``CUDA_VISIBLE_DEVICES`` to the claimed GPU
(worker/launch.py ``trainer_env``); its stderr goes to ``trainer.stderr.log`` in the job's
directory. The torchrun and multi-machine executors run their launcher the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from worker.executors.base import Executor, OnEvent, Signal
from worker.launch import run_tag, subcommand, trainer_argv, trainer_env
from worker.process import TrainerExit, TrainerProcess

if TYPE_CHECKING:
    from worker.claim import Claim
    from worker.runtime import Runtime


class LocalExecutor(Executor):
    """One trainer process on this host; subclasses change its command and environment."""

    def __init__(self, runtime: Runtime, claim: Claim) -> None:
        self.runtime = runtime
        self.claim = claim
        self.trainer: TrainerProcess | None = None
        """The launcher's process once started."""

    @property
    def ranks(self) -> int:
        """Processes the launcher starts that run the trainer (the trainer itself: one)."""
        return 1

    @property
    def rank_log_dir(self) -> Path:
        """Where torchrun keeps each rank's stderr (unused by the trainer alone)."""
        return self.claim.output_dir / "ranks" / f"attempt-{self.claim.attempt}"

    @property
    def stderr_path(self) -> Path:
        return self.claim.output_dir / "trainer.stderr.log"

    def argv(self, job_json: Path) -> list[str]:
        return trainer_argv(self.runtime.options, job_json)

    def env(self) -> dict[str, str]:
        return trainer_env(self.runtime, self.claim.devices)

    def start(self, job_json: Path, on_event: OnEvent) -> None:
        trainer = TrainerProcess(
            self.argv(job_json),
            on_event=on_event,
            env=self.env(),
            cwd=self.claim.output_dir,
            stderr_path=self.stderr_path,
            tail_lines=self.runtime.options.stderr_tail_lines,
            tag=run_tag(self.runtime.worker_id, self.claim.job_id, self.claim.attempt),
            ranks=self.ranks,
            rank_log_dir=self.rank_log_dir,
            stdin_pipe=subcommand(job_json) == "serve",  # a chat session reads its requests there
        )
        trainer.start()
        self.trainer = trainer

    def watch(self) -> bool:
        return self.trainer is not None and not self.trainer.has_exited()

    def signal(self, signal: Signal) -> bool:
        if self.trainer is None:
            return False
        if signal is Signal.stop:
            return self.trainer.terminate()
        self.trainer.kill()
        return True

    def collect(self) -> TrainerExit:
        if self.trainer is None:
            return TrainerExit(returncode=-1, stderr_tail=(), world_size=self.ranks)
        return self.trainer.finish()
