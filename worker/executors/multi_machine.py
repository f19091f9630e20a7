"""``multi_machine``: this machine's share of the ranks of a job over several machines.

The placement's parts are recorded in the claim (``reserve``: one ``job_node`` row per machine
and the leader's c10d rendezvous, worker/nodes.py ``record_parts``), then each follower is sent
``jobs.run_node`` (``announce``). Every machine runs torchrun at the rendezvous with its GPUs'
ranks, gloo and NCCL pinned to the interface of its address (worker/nodes.py ``pin_interface``):
the leader through the runner, a follower through worker/follower.py, both with this executor.

On the leader a ``PartsWatch`` kills the ranks once a follower machine is lost, and ``settle``
makes the failed run a retry from the last checkpoint (worker/nodes.py). A follower's files
carry its node rank (``trainer.node-<r>.stderr.log``), so machines sharing a disk keep theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from worker import nodes
from worker.executors.base import OnEvent
from worker.executors.torchrun import TorchrunExecutor
from worker.process import TrainerExit

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from core.jobs.placement import Placement
    from core.settings import Settings
    from worker.claim import Claim
    from worker.launch import Rendezvous
    from worker.outcome import Outcome
    from worker.runtime import Runtime


class MultiMachineExecutor(TorchrunExecutor):
    """torchrun at the claim's rendezvous; node rank 0 (the leader) also watches the other parts."""

    def __init__(self, runtime: Runtime, claim: Claim) -> None:
        assert claim.rendezvous is not None, f"job {claim.job_id}: a multi-machine run without its rendezvous"
        super().__init__(runtime, claim)
        self.rendezvous: Rendezvous = claim.rendezvous
        self.parts: nodes.PartsWatch | None = None

    @classmethod
    def reserve(cls, session: Session, settings: Settings, placement: Placement, attempt: int) -> Rendezvous | None:
        return nodes.record_parts(session, settings, placement, attempt)

    @classmethod
    def announce(cls, runtime: Runtime, job_id: str, attempt: int) -> None:
        nodes.send_followers(runtime, job_id, attempt)

    @property
    def _leader(self) -> bool:
        return self.rendezvous.node_rank == 0

    @property
    def rank_log_dir(self) -> Path:
        node = "" if self._leader else f"-node-{self.rendezvous.node_rank}"
        return self.claim.output_dir / "ranks" / f"attempt-{self.claim.attempt}{node}"

    @property
    def stderr_path(self) -> Path:
        node = "" if self._leader else f".node-{self.rendezvous.node_rank}"
        return self.claim.output_dir / f"trainer{node}.stderr.log"

    def env(self) -> dict[str, str]:
        return nodes.pin_interface(super().env(), self.rendezvous)

    def start(self, job_json: Path, on_event: OnEvent) -> None:
        super().start(job_json, on_event)
        if self._leader:
            assert self.trainer is not None
            self.parts = nodes.PartsWatch(self.runtime, self.claim.job_id, self.claim.attempt, self.trainer)
            self.parts.start()

    def collect(self) -> TrainerExit:
        if self.parts is not None:
            self.parts.stop()
        return super().collect()

    def settle(self, outcome: Outcome, *, max_attempts: int) -> Outcome:
        if self.parts is None:
            return outcome
        return self.parts.settle(outcome, max_attempts=max_attempts)
