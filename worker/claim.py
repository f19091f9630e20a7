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

    @property
    def gpus(self) -> int:
        return len(self.slots)
