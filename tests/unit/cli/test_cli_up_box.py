"""The box ``ftq up`` prints last (``cli.up.welcome_box``): the URLs, the admin key on the first start
only, where the key is on later starts, the PATH line; every copyable value whole on one line. And
the first start's key: saved at once, printed only in the box."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli.main import main
from cli.up import box_facts, welcome_box
from cli.users import bootstrap_admin
from core.settings import Settings

URL = "http://127.0.0.1:8123"
KEY = "ftq_3f9c01ab_" + "Q" * 43
CONFIG = Path("/home/you/.config/ftq/config.toml")
BIN = Path("/home/you/a checkout with a long name/ftq/.venv/bin")


def rows(box: str) -> list[str]:
    """The box's text lines, without the frame."""
    lines = box.splitlines()
    assert re.fullmatch(r"\+-+\+", lines[0]) and lines[-1] == lines[0], box
    assert all(len(line) == len(lines[0]) and line.startswith("| ") and line.endswith(" |") for line in lines[1:-1])
    return [line[2:-2].rstrip() for line in lines[1:-1]]


def joined(box: str) -> str:
    return " ".join(" ".join(line.split()) for line in rows(box))


class TestWelcomeBox:
    def test_the_first_start_shows_the_urls_the_saved_key_once_and_the_path_line(self):
        box = welcome_box(URL, new_key=KEY, config_file=CONFIG, saved_key=KEY, bin_dir=BIN)
        lines = rows(box)
        assert lines[0].split() == ["Dashboard", f"{URL}/"]
        assert lines[1].split() == ["API", "docs", f"{URL}/docs"]
        assert lines[2].split() == ["Admin", "key", KEY]
        assert box.count(KEY) == 1
        text = joined(box)
        assert "shown once" in text and f"Saved to {CONFIG}" in text and "dashboard's login" in text
        assert "ftq users create NAME" in text
        assert any(line.endswith(f'export PATH="{BIN}:$PATH"') for line in lines), box
        assert "another terminal" in text
        assert box.isascii()

    def test_a_key_that_could_not_be_saved_says_how_to_save_it(self):
        box = welcome_box(URL, new_key=KEY, config_file=CONFIG, saved_key=None, bin_dir=BIN)
        text = joined(box)
        assert box.count(KEY) == 1 and f"Not saved to {CONFIG}" in text and "ftq login --key" in text

    def test_a_later_start_says_where_the_key_is_and_never_prints_it(self):
        box = welcome_box(URL, new_key=None, config_file=CONFIG, saved_key=KEY, bin_dir=BIN)
        text = joined(box)
        assert KEY not in box and "Admin key" not in text
        assert f"API key saved in {CONFIG}" in text and "ftq users key admin" in text

    def test_a_later_start_without_a_saved_key_says_how_to_get_one(self):
        text = joined(welcome_box(URL, new_key=None, config_file=CONFIG, saved_key=None, bin_dir=BIN))
        assert f"none saved in {CONFIG}" in text
        assert "ftq users key admin" in text and "ftq login --key" in text

    def test_without_a_known_ftq_command_there_is_no_path_line(self):
        box = welcome_box(URL, new_key=None, config_file=CONFIG, saved_key=KEY, bin_dir=None)
        assert "PATH" not in box

    def test_long_values_widen_the_box_instead_of_wrapping(self):
        long_url = "http://a-very-long-host-name-for-a-gpu-box.example.internal.corp:8000"
        box = welcome_box(long_url, new_key=KEY, config_file=CONFIG, saved_key=KEY, bin_dir=BIN / ("x" * 80))
        lines = rows(box)
        assert f"{long_url}/docs" in lines[1] and any(f'export PATH="{BIN / ("x" * 80)}:$PATH"' in line for line in lines)
        prose = [line for line in lines if "shown once" in line or "paste it" in line]
        assert prose and all(len(line.strip()) <= len("ftq on PATH  ") + 64 for line in prose)


class TestFirstStartKey:
    @pytest.fixture
    def store(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> Settings:
        for name in ("FTQ_DATABASE_URL", "FTQ_BROKER_URL", "FTQ_REDIS_URL", "FTQ_API_KEY", "FTQ_CONFIG"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("FTQ_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
        assert main(["db", "upgrade"]) == 0
        capsys.readouterr()
        return Settings().resolved()

    def test_the_key_is_saved_at_once_and_printed_only_in_the_box(self, store, tmp_path, capsys):
        key = bootstrap_admin(store, show_key=False)
        early = capsys.readouterr().out
        assert key and key not in early and "shown once the service is up" in early
        facts = box_facts()
        assert facts["config_file"] == tmp_path / "xdg" / "ftq" / "config.toml" and facts["saved_key"] == key
        box = welcome_box(URL, new_key=key, **facts)
        assert box.count(key) == 1 and f"Saved to {facts['config_file']}" in joined(box)
        assert bootstrap_admin(store, show_key=False) is None and capsys.readouterr().out == ""
        assert key not in welcome_box(URL, new_key=None, **box_facts())
