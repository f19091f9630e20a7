"""The fault suite's stack: its own PostgreSQL and Redis (``services.py``, started here in tmp on
free ports, never the machine's), ``ftq api`` and ``ftq worker`` as separate processes, a tiny
random-weight Llama (a copy of ``tiny_llama``), a small chat dataset (``chat_dataset``; both
tests/fixtures/training_inputs.py). One stack per module: starting one costs ~10 s of
imports on 2 cores, and each test leaves it running (a test that kills a part restarts it).

Only processes this suite started are signalled: the servers through their own ``Popen``, the
API and worker through ``Stack`` (their sessions), the trainer by its job tag.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.faults.services import ThrowawayPostgres, ThrowawayRedis, free_port
from tests.fixtures.stack import MODEL, STACK_ENV, Stack


@pytest.fixture(scope="session")
def fault_model_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """A model root holding a copy of ``tiny_llama``."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_llama, root / MODEL)
    return root


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory, fault_model_root: Path) -> Iterator[SimpleNamespace]:
    """``.stack`` (API + worker), ``.pg`` and ``.redis`` (throwaway servers the tests may kill)."""
    base = tmp_path_factory.mktemp("faults")
    pg, redis = ThrowawayPostgres(base / "pgroot"), ThrowawayRedis(base / "redis")
    port = free_port()
    stack = Stack("faults", f"http://127.0.0.1:{port}", base / "data", fault_model_root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
    env.update(STACK_ENV, FTQ_DATA_DIR=str(stack.data_dir), FTQ_MODEL_ROOT=str(fault_model_root),
               FTQ_CONFIG=str(base / "client-config.toml"), FTQ_DATABASE_URL=pg.url, FTQ_BROKER_URL=redis.url,
               FTQ_REDIS_URL=redis.url, FTQ_PORT=str(port), FTQ_HEARTBEAT_TIMEOUT_S="8", FTQ_MAX_ATTEMPTS="10")
    stack.env = env
    stack.worker_id = "faults"
    try:
        pg.start()
        redis.start()
        subprocess.run([sys.executable, "-m", "cli", "db", "upgrade"], env=env, check=True, capture_output=True,
                       timeout=120)
        stack.api_key = stack.create_user("faults", "--admin")
        stack.start("api", [sys.executable, "-m", "cli", "api"], env)
        stack.start("worker", [sys.executable, "-m", "cli", "worker", "--name", stack.worker_id], env)
        stack.wait_ready()
        yield SimpleNamespace(stack=stack, pg=pg, redis=redis)
    finally:
        stack.stop()
        redis.stop()
        pg.stop()
