"""``torchrun``: one rank per reserved GPU of this host, under a rendezvous of its own.

torchrun (``--standalone``, worker/launch.py ``torchrun_argv``) starts the ranks, each in a
session of its own; ``Signal.stop`` reaches every rank (not torchrun, which would SIGKILL them
30 s later) and ``collect`` reads torchrun's failure summary and each failed rank's stderr
(worker/process.py).
"""

from __future__ import annotations

from pathlib import Path

from worker.executors.local import LocalExecutor
from worker.launch import torchrun_argv


class TorchrunExecutor(LocalExecutor):
    """torchrun over the claim's GPUs of this host (``LocalExecutor``'s process handling)."""

    @property
    def ranks(self) -> int:
        return self.claim.gpus

    def argv(self, job_json: Path) -> list[str]:
        return torchrun_argv(self.runtime.options, job_json, ranks=self.ranks, rank_log_dir=self.rank_log_dir,
                             rendezvous=self.claim.rendezvous)
