"""The API stays light and inside its boundary: no torch, no worker, nothing at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from api.jobs.sse import format_event

REPO = Path(__file__).resolve().parents[3]


def test_importing_and_building_the_app_pulls_no_torch_or_worker() -> None:
    code = (
        "import sys; from api.app import create_app; create_app(); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'transformers', 'peft')); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_app_uses_only_the_trainers_standard_library_modules() -> None:
    """``trainer.plan.memory`` is the estimate ``GET /v1/models`` says whether a model fits with
    (``api.models.fit``); ``test_models_fit`` checks that computing it imports no torch."""
    code = (
        "import sys; from api.app import create_app; create_app(); "
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'trainer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert set(out.stdout.strip().split(",")) <= {"trainer", "trainer.config", "trainer.events", "trainer.training",
                                                   "trainer.training.layout", "trainer.plan", "trainer.plan.memory"}


def test_sse_event_format() -> None:
    assert format_event(7, "step", {"step": 3, "loss": 0.5}) == b'id: 7\nevent: step\ndata: {"step":3,"loss":0.5}\n\n'
