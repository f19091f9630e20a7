"""The client commands' fixtures: the real API app in process (SQLite store, no worker) and a job file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from api.app import create_app
from core.migrate import upgrade
from core.settings import Settings
from tests.helpers import CHAT_RECORD, create_api_key


@pytest.fixture
def api(tmp_path: Path, model_root: Path) -> Iterator[TestClient]:
    """A client of the app on a fresh SQLite store that sends an admin's key."""
    settings = Settings(data_dir=tmp_path / "data", model_root=model_root, allow_hub_models=False,
                        sse_poll_interval_s=0.05).resolved()
    upgrade(settings.database_url)
    key = create_api_key(settings.database_url)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {key}"}) as client:
        yield client


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    """``job.yaml`` for model ``tiny`` next to a one-record ``train.jsonl``."""
    (tmp_path / "train.jsonl").write_text(json.dumps(CHAT_RECORD) + "\n")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "training_file": "train.jsonl",
                                    "hyperparameters": {"max_steps": 5, "batch_tokens": 256, "max_seq_len": 64}}))
    return path
