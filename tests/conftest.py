"""Fixtures every test may use. Nothing here touches a server: see tests/integration/conftest.py.
Plain helpers (not fixtures) are in tests/helpers.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture
def model_root(tmp_path: Path) -> Path:
    """A model root holding ``tiny/config.json`` (enough for submission checks, not for training)."""
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    (root / "tiny" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return root


def pytest_configure(config: pytest.Config) -> None:
    try:  # the GPU image runs tests/gpu without the service's packages
        import sqlalchemy  # noqa: F401
    except ImportError:
        return
    # kombu's SQLAlchemy transport (the embedded broker) declares a relationship with
    # lazy="noload", deprecated in SQLAlchemy 2.1; it is kombu's to fix, not an ftq bug.
    config.addinivalue_line(
        "filterwarnings", "ignore:The ``noload`` loader strategy is deprecated:sqlalchemy.exc.SADeprecationWarning"
    )
