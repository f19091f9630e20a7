"""Fixtures of the core unit tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import sessionmaker

from core import migrate
from core.db import make_engine, make_sessionmaker
from core.settings import Settings


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[sessionmaker, Settings]]:
    """A migrated SQLite store and the box's settings, with a local model ``tiny`` in the model root."""
    url = f"sqlite:///{tmp_path / 'ftq.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    yield make_sessionmaker(engine), Settings(data_dir=tmp_path, model_root=tmp_path / "models",
                                              allow_hub_models=False).resolved()
    engine.dispose()
