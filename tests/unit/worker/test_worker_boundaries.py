"""The worker touches the trainer only through its CLI and its standard-library modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TRAINER_MODULES_FOR_THE_WORKER = {"trainer", "trainer.catalog", "trainer.config", "trainer.events", "trainer.training",
                                  "trainer.training.layout", "trainer.objectives", "trainer.objectives.registry",
                                  "trainer.objectives.declarations", "trainer.objectives.grpo_config", "trainer.generate",
                                  "trainer.generate.job_config", "trainer.generate.outputs", "trainer.evals",
                                  "trainer.evals.config"}
"""``trainer.objectives`` is its torch-free registry: the step fields the recorder stores and the trackers send
(``grpo_config``: GRPO's section, standard library);
``trainer.generate.job_config`` a generation job's job.json, ``trainer.evals.config`` an eval run's,
``trainer.generate.outputs`` its lines on disk (a remote worker merges the API's part files into its own)
(standard library only)."""


def test_importing_the_worker_pulls_no_torch_and_only_the_trainers_stdlib_modules() -> None:
    code = (
        "import sys; import worker.app, worker.tasks, worker.runner, worker.presence, worker.recorder, "
        "worker.remote_generation; "
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('trainer', 'torch', 'transformers', 'peft', 'api'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert set(out.stdout.strip().split(",")) <= TRAINER_MODULES_FOR_THE_WORKER
