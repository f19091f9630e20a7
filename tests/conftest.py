"""Fixtures every test may use. Nothing here touches a server: see tests/integration/conftest.py."""

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


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def create_api_key(database_url: str, name: str = "admin", *, is_admin: bool = True) -> str:
    """Create user ``name`` in the (migrated) store at ``database_url``; returns its API key."""
    from core.db import make_engine, make_sessionmaker
    from core.users.service import create_user_with_key

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            _user, issued = create_user_with_key(session, name, is_admin=is_admin)
            session.commit()
            return issued.secret
    finally:
        engine.dispose()


CHAT_RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


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
