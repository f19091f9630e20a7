"""A job this host claimed: which attempt, where it writes, the GPUs it holds, how it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.launch import Rendezvous


@dataclass(frozen=True)
class Claim:
    job_id: str
    attempt: int
    output_dir: Path
    slots: tuple[int, ...] = (0,)
    """The slots of this host's pool the job holds."""
    devices: tuple[str | None, ...] = (None,)
    """Those slots' GPUs as CUDA_VISIBLE_DEVICES names them (None: CPU slots)."""
    rendezvous: Rendezvous | None = None
    """A multi-machine job's, on its leader (worker/nodes.py); None on one machine."""
    executor: str = "local"
    """The name of the executor that runs it (worker/executors/), picked from the placement."""
    shared_home: Path | None = None
    """A multi-machine job's directory in the storage all its machines share
    (worker/shared_storage.py): its checkpoints go there, none is uploaded. None: this machine's
    ``output_dir``."""

    @property
    def checkpoint_home(self) -> Path:
        """The directory whose ``checkpoints/`` holds the run's checkpoints."""
        return self.shared_home or self.output_dir

    @property
    def gpus(self) -> int:
        return len(self.slots)
