"""End-to-end stacks: a real uvicorn API and a real Celery worker, as separate processes.

Two stores, one fixture (``stack``, parametrized):

``postgres``  a fresh PostgreSQL database per stack, copied from one that ``ftq db upgrade``
              migrated once per test process (tests/fixtures/e2e_stacks.py), Redis as broker and pub/sub on an empty Redis db; ``ftq api`` and
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

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.e2e_stacks import embedded_stack, postgres_stack, remote_worker_stack
from tests.fixtures.stack import CORRUPT_MODEL, MODEL, POISONED_MODEL, Stack
from tests.poison import poison_model

@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(tiny_llama, root / MODEL)
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


@pytest.fixture(scope="module", params=["postgres", "embedded"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp(request.param)
    if request.param == "postgres":
        yield from postgres_stack(base, model_root)
    else:
        yield from embedded_stack(base, model_root)


@pytest.fixture(scope="module")
def pool_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """The PostgreSQL + Redis stack whose one worker host has 3 CPU slots (``ftq worker --slots 3``):
    a job of N "GPUs" runs N ranks on the CPU under torchrun (gloo)."""
    yield from postgres_stack(tmp_path_factory.mktemp("pool"), model_root, worker_args=("--slots", "3"))


@pytest.fixture(scope="module")
def fast_reaping_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """The PostgreSQL + Redis stack with a 4 s heartbeat timeout, for worker-loss tests."""
    yield from postgres_stack(tmp_path_factory.mktemp("reaping"), model_root, {"FTQ_HEARTBEAT_TIMEOUT_S": "4"})


@pytest.fixture(scope="module")
def remote_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """An API on PostgreSQL + Redis, and one worker with a worker key and a data dir of its own."""
    yield from remote_worker_stack(tmp_path_factory.mktemp("remote"), model_root)
