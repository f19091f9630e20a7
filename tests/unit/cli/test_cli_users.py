"""``ftq users ...``, ``ftq login``, the client config file and ``ftq up``'s first admin."""

from __future__ import annotations

import contextlib
import json
import re
import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from cli import client as cli_client
from cli import config
from cli.main import main
from cli.users import bootstrap_admin
from core.db import make_engine, make_sessionmaker
from core.errors import Unauthenticated
from core.settings import Settings
from core.users import service

KEY = re.compile(r"ftq_[0-9a-f]{8}_[A-Za-z0-9_-]{40,}")


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> Settings:
    """An embedded store under tmp, migrated; the client config in tmp too."""
    for name in ("FTQ_DATABASE_URL", "FTQ_BROKER_URL", "FTQ_REDIS_URL", "FTQ_API_KEY", "FTQ_API_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("FTQ_CONFIG", raising=False)
    assert main(["db", "upgrade"]) == 0
    capsys.readouterr()
    return Settings().resolved()


def verify(settings: Settings, key: str) -> service.Caller:
    engine = make_engine(settings.database_url or "")
    try:
        with make_sessionmaker(engine)() as session:
            return service.verify_key(session, key)
    finally:
        engine.dispose()


class TestUsersCommands:
    def test_create_prints_a_working_key_exactly_once(self, box, capsys):
        assert main(["users", "create", "alice", "--admin", "--max-running", "2"]) == 0
        out = capsys.readouterr().out
        [key] = KEY.findall(out)
        assert "shown once" in out and "created admin alice" in out
        caller = verify(box, key)
        assert (caller.name, caller.is_admin) == ("alice", True)

    def test_list_shows_prefixes_never_keys(self, box, capsys):
        main(["users", "create", "alice", "--max-running", "2"])
        key = KEY.findall(capsys.readouterr().out)[0]
        assert main(["users", "list"]) == 0
        out = capsys.readouterr().out
        assert "alice" in out and key.split("_")[1] in out and key not in out
        assert re.search(r"alice\s+2\s", out)

    def test_key_then_revoke_by_prefix(self, box, capsys):
        main(["users", "create", "bob"])
        first = KEY.findall(capsys.readouterr().out)[0]
        assert main(["users", "key", "bob", "--label", "laptop"]) == 0
        second = KEY.findall(capsys.readouterr().out)[0]
        assert first != second
        assert main(["users", "revoke", first.split("_")[1]]) == 0
        assert "revoked key" in capsys.readouterr().out
        with pytest.raises(Unauthenticated, match="revoked"):
            verify(box, first)
        assert verify(box, second).name == "bob"

    def test_set_changes_the_cap_and_disables(self, box, capsys):
        main(["users", "create", "bob"])
        key = KEY.findall(capsys.readouterr().out)[0]
        assert main(["users", "set", "bob", "--max-running", "3"]) == 0
        assert "max running 3" in capsys.readouterr().out
        assert main(["users", "set", "bob", "--max-running", "default", "--disable"]) == 0
        assert "max running default, disabled" in capsys.readouterr().out
        with pytest.raises(Unauthenticated, match="disabled"):
            verify(box, key)
        assert main(["users", "set", "bob", "--max-running", "lots"]) == 2

    def test_refusals_are_readable(self, box, capsys):
        assert main(["users", "create", "Not A Name"]) == 2
        assert "is not a user name" in capsys.readouterr().err
        main(["users", "create", "bob"])
        capsys.readouterr()
        assert main(["users", "create", "bob"]) == 2
        assert "exists" in capsys.readouterr().err
        assert main(["users", "key", "nobody"]) == 2
        assert "no user 'nobody'" in capsys.readouterr().err
        assert main(["users", "revoke", "00000000"]) == 2

    def test_refuses_a_store_without_schema(self, tmp_path, monkeypatch, capsys):
        monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path / "empty"))
        monkeypatch.delenv("FTQ_DATABASE_URL", raising=False)
        (tmp_path / "empty").mkdir()
        assert main(["users", "list"]) == 2
        assert "run `ftq db upgrade` first" in capsys.readouterr().err


class TestConfigFile:
    def test_saved_with_mode_0600_and_read_back(self, box):
        path = config.save_config({"api_key": "ftq_x", "api_url": "http://box:8000"})
        assert path == Path(box.data_dir).parent / "xdg" / "ftq" / "config.toml"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert config.api_key() == "ftq_x" and config.configured_url() == "http://box:8000"
        assert cli_client.api_url() == "http://box:8000"

    def test_environment_wins_over_the_file(self, box, monkeypatch):
        config.save_config({"api_key": "from-file"})
        monkeypatch.setenv("FTQ_API_KEY", "from-env")
        assert config.api_key() == "from-env"
        assert cli_client.connect().headers["Authorization"] == "Bearer from-env"

    def test_a_json_config_is_read_and_a_broken_one_is_named(self, box, tmp_path, monkeypatch, capsys):
        js = tmp_path / "xdg" / "ftq" / "config.json"
        js.parent.mkdir(parents=True)
        js.write_text(json.dumps({"api_key": "ftq_json"}))
        assert config.config_path() == js and config.api_key() == "ftq_json"
        js.write_text("{not json")
        assert main(["jobs"]) == 2
        assert "cannot read the ftq config" in capsys.readouterr().err


class TestLoginAndBootstrap:
    def test_first_start_creates_admin_prints_and_saves_the_key(self, box, capsys):
        key = bootstrap_admin(box)
        out = capsys.readouterr().out
        assert key is not None and KEY.findall(out) == [key]
        assert "saved it to" in out and "ftq users create" in out
        assert config.api_key() == key
        assert verify(box, key).is_admin
        assert bootstrap_admin(box) is None  # users exist: nothing new, nothing printed
        assert capsys.readouterr().out == ""

    def test_login_checks_the_key_then_saves_it(self, box, capsys, monkeypatch):
        key = bootstrap_admin(box)
        capsys.readouterr()
        (Path(box.data_dir).parent / "xdg" / "ftq" / "config.toml").unlink()
        app = create_app(box)
        with TestClient(app) as test_client:
            def connect(base_url=None, api_key=None):
                test_client.headers["Authorization"] = f"Bearer {api_key}"
                return contextlib.nullcontext(test_client)  # the test owns the client's lifespan

            monkeypatch.setattr(cli_client, "connect", connect)
            assert main(["login", "--key", key + "x"]) == 2
            err = capsys.readouterr().err
            assert "401" in err and "not valid" in err and "ftq login" in err
            assert config.load_config() == {}
            assert main(["login", "--key", key]) == 0
        assert "as admin (admin)" in capsys.readouterr().out
        assert config.load_config() == {"api_key": key}
