"""End-to-end stacks: a real uvicorn API and a real Celery worker, as separate processes.

Two stores, one fixture (``stack``, parametrized):

``postgres``  a fresh PostgreSQL database per session (``ftq db upgrade`` applies the
              migrations), Redis as broker and pub/sub on an empty Redis db; ``ftq api`` and
              ``ftq worker`` started separately, as in production.
``embedded``  ``ftq up`` with no URL set: SQLite store and SQLAlchemy broker in a tmp data dir.

``pool_stack`` is the PostgreSQL stack with a worker of 3 CPU slots (multi-GPU jobs on CPU ranks).

Both authenticate as an admin made the way a user would: the embedded stack reads the key
that ``ftq up`` created on its first start and saved to the client config (``FTQ_CONFIG`` in
tmp); the PostgreSQL stack runs ``ftq users create e2e --admin`` and reads the printed key.

The model root holds a tiny random-weight Llama made by ``python -m trainer make-tiny-model``,
a copy whose weights file is cut short (a trainer that must fail) and a copy with NaN embeddings
for a few tokens (``tests.poison``: training on them is non-finite). Without PostgreSQL or
Redis the ``postgres`` stack is skipped locally and fails under CI (``CI`` set).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.e2e.stack import CORRUPT_MODEL, MODEL, POISONED_MODEL, STACK_ENV, Stack, free_port, read_bootstrap_key
from tests.poison import poison_model

PG_ADMIN_URL = os.environ.get("FTQ_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("FTQ_TEST_REDIS", "redis://127.0.0.1:6379")
WORDS = ("the cat sat on a mat and the dog ran in the park while birds sang songs of spring "
         "under a bright blue sky near the old stone bridge").split()

def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the end-to-end tests; scripts/services.sh starts it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    subprocess.run(
        [sys.executable, "-m", "trainer", "make-tiny-model", str(root / MODEL), "--arch", "llama"],
        check=True, capture_output=True, timeout=300,
    )
    corrupt = root / CORRUPT_MODEL
    shutil.copytree(root / MODEL, corrupt)
    # Sizes that agree with the header (what submission checks) but a dtype safetensors does not
    # know (same length, so the offsets hold): the job is accepted and its trainer fails to load the
    # weights ("Error while deserializing header"). A truncated file is refused at submission.
    weights = (corrupt / "model.safetensors").read_bytes()
    end = 8 + int.from_bytes(weights[:8], "little")
    header = weights[8:end].decode()
    assert '"dtype":"F32"' in header, header[:200]
    header = header.replace('"dtype":"F32"', '"dtype":"Z32"')
    (corrupt / "model.safetensors").write_bytes(weights[:8] + header.encode() + weights[end:])
    poison_model(root / MODEL, root / POISONED_MODEL)
    return root


@pytest.fixture(scope="session")
def chat_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 short chat records over a small vocabulary: a tiny model learns it within steps."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for _ in range(64):
            question = " ".join(rng.choices(WORDS, k=6))
            answer = " ".join(rng.choices(WORDS[:8], k=12))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def _base_env(data_dir: Path, model_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTQ_")}
    env.update(STACK_ENV, FTQ_DATA_DIR=str(data_dir), FTQ_MODEL_ROOT=str(model_root),
               FTQ_CONFIG=str(data_dir.parent / "client-config.toml"))
    return env


@pytest.fixture(scope="module", params=["postgres", "embedded"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp(request.param)
    if request.param == "postgres":
        yield from _postgres_stack(base, model_root)
    else:
        yield from _embedded_stack(base, model_root)


def _embedded_stack(base: Path, model_root: Path) -> Iterator[Stack]:
    port = free_port()
    stack = Stack("embedded", f"http://127.0.0.1:{port}", base / "data", model_root)
    env = _base_env(stack.data_dir, model_root)
    env["FTQ_PORT"] = str(port)
    stack.env = env
    stack.start("up", [sys.executable, "-m", "cli", "up", "--no-demo-model"], env)
    try:
        stack.api_key = read_bootstrap_key(stack)
        stack.wait_ready()
        yield stack
    finally:
        codes = stack.stop()
    assert codes["up"] == 0, f"ftq up did not stop cleanly: {codes}\n{stack.log_tail()}"


def _postgres_stack(base: Path, model_root: Path, extra_env: dict[str, str] | None = None,
                    worker_args: tuple[str, ...] = ()) -> Iterator[Stack]:
    import psycopg
    import redis

    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {exc}")
    db_name = f"ftq_e2e_{uuid.uuid4().hex[:12]}"
    redis_db = _empty_redis_db(redis)
    admin.execute(f'CREATE DATABASE "{db_name}"')
    port = free_port()
    stack = Stack("postgres", f"http://127.0.0.1:{port}", base / "data", model_root)
    env = _base_env(stack.data_dir, model_root)
    env.update(
        FTQ_DATABASE_URL=PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + "/" + db_name,
        FTQ_BROKER_URL=f"{REDIS_URL}/{redis_db}",
        FTQ_REDIS_URL=f"{REDIS_URL}/{redis_db}",
        FTQ_PORT=str(port),
    )
    env.update(extra_env or {})
    stack.env = env
    try:
        subprocess.run([sys.executable, "-m", "cli", "db", "upgrade"], env=env, check=True, capture_output=True,
                       timeout=120)
        stack.api_key = stack.create_user("e2e", "--admin")
        stack.start("api", [sys.executable, "-m", "cli", "api"], env)
        stack.worker_id = f"e2e-{db_name}"
        stack.start("worker", [sys.executable, "-m", "cli", "worker", "--name", stack.worker_id, *worker_args], env)
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()
        client = redis.Redis.from_url(f"{REDIS_URL}/{redis_db}")
        client.flushdb()  # this db was empty when the session took it
        client.close()
        admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        admin.close()


def _empty_redis_db(redis: Any) -> int:
    """A Redis db with no keys, so this session's queue shares nothing with anyone.

    Claimed with a key set only if absent: two test processes (pytest-xdist workers) that see
    the same empty db at once cannot both take it; the loser looks further.
    """
    try:
        for db in range(14, 0, -1):  # 15 belongs to tests/integration/conftest.py
            client = redis.Redis.from_url(f"{REDIS_URL}/{db}", socket_connect_timeout=5)
            try:
                if client.dbsize() == 0 and client.set("ftq:test:claimed-by", os.getpid(), nx=True):
                    return db
            finally:
                client.close()
    except redis.exceptions.ConnectionError as exc:
        _unavailable(f"Redis is not reachable at {REDIS_URL}: {exc}")
    _unavailable(f"Redis at {REDIS_URL} has no empty db among 1-14 for the end-to-end queue")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def pool_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """The PostgreSQL + Redis stack whose one worker host has 3 CPU slots (``ftq worker --slots 3``):
    a job of N "GPUs" runs N ranks on the CPU under torchrun (gloo)."""
    yield from _postgres_stack(tmp_path_factory.mktemp("pool"), model_root, worker_args=("--slots", "3"))


@pytest.fixture(scope="module")
def fast_reaping_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """The PostgreSQL + Redis stack with a 4 s heartbeat timeout, for worker-loss tests."""
    yield from _postgres_stack(tmp_path_factory.mktemp("reaping"), model_root, {"FTQ_HEARTBEAT_TIMEOUT_S": "4"})
