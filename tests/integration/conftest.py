"""Real stores for the integration tests: PostgreSQL and the SQLite default, both migrated to head.

PostgreSQL: a fresh database ``ftq_test_<pid>`` on ``FTQ_TEST_POSTGRES_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``, used only to create and drop it), built
by running the migrations, dropped at the end. An unreachable server FAILS the tests with the
reason (CI starts the services first); nothing is skipped silently. Every test that takes
``store`` runs once per backend and finds the tables empty.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from core.db import make_engine, make_sessionmaker
from core.migrate import upgrade
from core.settings import Settings
from tests.integration.helpers import bearer, make_user

ADMIN_URL = os.environ.get("FTQ_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("FTQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
TABLES = ("session_message", "eval_run", "eval", "gpu_slot", "step_metric", "eval_metric", "checkpoint", "job_event", "job", "file", "worker", "worker_key", "api_key", "user", "project_member", "project")


@dataclass
class Store:
    backend: str
    url: str
    engine: Engine
    sessions: sessionmaker


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"ftq_test_{os.getpid()}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
            conn.execute(text(f"CREATE DATABASE {name}"))
    except Exception as exc:
        admin.dispose()
        pytest.fail(
            f"PostgreSQL is unreachable at {ADMIN_URL} ({type(exc).__name__}: {exc}); start it "
            "(.ci/run does) or point FTQ_TEST_POSTGRES_URL at a server where CREATE DATABASE is allowed",
            pytrace=False,
        )
    url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'ftq.db'}"
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def _engines() -> Iterator[dict[str, Engine]]:
    engines: dict[str, Engine] = {}
    yield engines
    for engine in engines.values():
        engine.dispose()


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest, _engines: dict[str, Engine]) -> Iterator[Store]:
    backend = request.param
    url = request.getfixturevalue("postgres_url" if backend == "postgresql" else "sqlite_url")
    engine = _engines.get(backend) or _engines.setdefault(backend, make_engine(url))
    yield Store(backend, url, engine, make_sessionmaker(engine))
    with engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f'DELETE FROM "{table}"'))


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except Exception as exc:
        pytest.fail(
            f"Redis is unreachable at {REDIS_URL} ({exc}); start it (.ci/run does) or set FTQ_TEST_REDIS_URL",
            pytrace=False,
        )
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def settings(store: Store, tmp_path: Path, model_root: Path) -> Settings:
    """Settings for an API on ``store``; the broker is kombu's SQLite transport in tmp."""
    return Settings(
        data_dir=tmp_path / "data",
        model_root=model_root,
        database_url=store.url,
        broker_url=f"sqla+sqlite:///{tmp_path / 'broker.db'}",
        redis_url=None,
        max_upload_bytes=64 * 1024,
        sse_heartbeat_s=15.0,
        sse_poll_interval_s=0.05,
    ).resolved()


@pytest.fixture
def sched_settings(store: Store, tmp_path: Path) -> Settings:
    """Settings for claims on ``store`` without an API: one running job per user."""
    return Settings(data_dir=tmp_path / "data", database_url=store.url, max_running_jobs_per_user=1).resolved()


@pytest.fixture
def admin_key(store: Store) -> str:
    """The API key of ``admin``, an admin user every API test starts with."""
    return make_user(store, "admin", is_admin=True)


@pytest.fixture
def client(settings: Settings, admin_key: str) -> Iterator[TestClient]:
    """A client of the app that sends ``admin``'s key on every request."""
    from api.app import create_app

    with TestClient(create_app(settings), headers=bearer(admin_key)) as test_client:
        yield test_client


@pytest.fixture
def oai(client: TestClient, admin_key: str) -> Iterator[openai.OpenAI]:
    """The official ``openai`` client over ``client`` (the app in this process) with ``admin``'s key."""
    with openai.OpenAI(base_url="http://testserver/openai/v1", api_key=admin_key, http_client=client,
                       max_retries=0) as sdk:
        yield sdk
