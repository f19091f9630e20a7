"""core.jobs.model_source: local directories under the root, hub ids, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import InvalidInput
from core.jobs.model_source import resolve_model


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "models" / "org" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "org" / "tiny" / "config.json").write_text(json.dumps({}))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text("{}")
    return tmp_path / "models"


def test_local_directory_wins_over_a_hub_id_of_the_same_name(root: Path) -> None:
    source = resolve_model("org/tiny", model_root=root)
    assert (source.kind, source.name_or_path) == ("local", str(root / "org" / "tiny"))
    assert resolve_model(str(root / "org" / "tiny"), model_root=root).kind == "local"


def test_hub_id_online_and_offline(root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_model("Qwen/Qwen3-0.6B", model_root=root).kind == "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("core.jobs.model_source._in_hf_cache", lambda repo: repo == "cached/model")
    assert resolve_model("cached/model", model_root=root).name_or_path == "cached/model"
    with pytest.raises(InvalidInput, match="not in the local Hugging Face cache"):
        resolve_model("Qwen/Qwen3-0.6B", model_root=root)
    with pytest.raises(InvalidInput, match="hub models are disabled"):
        resolve_model("Qwen/Qwen3-0.6B", model_root=root, allow_hub=False)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("../outside", "'..' is not allowed"),
        ("org/../../outside", "'..' is not allowed"),
        ("ORIGIN/outside", "outside the model root"),
        ("org", "has no config.json"),
        ("just-a-name", "not a hub id"),
        ("a/b/c", "not a hub id"),
    ],
)
def test_refused_names_say_why(root: Path, tmp_path: Path, name: str, fragment: str) -> None:
    name = name.replace("ORIGIN", str(tmp_path))
    with pytest.raises(InvalidInput, match=fragment) as info:
        resolve_model(name, model_root=root)
    assert info.value.param == "model"


def test_symlink_escaping_the_root_is_refused(root: Path, tmp_path: Path) -> None:
    (root / "escape").symlink_to(tmp_path / "outside")
    with pytest.raises(InvalidInput, match="outside the model root"):
        resolve_model("escape", model_root=root)


def test_offline_hub_id_is_found_in_a_real_cache_layout(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hf-cache"
    repo = cache / "models--org--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model("org/cached", model_root=root).kind == "hub"
    with pytest.raises(InvalidInput, match="not in the local Hugging Face cache"):
        resolve_model("org/other", model_root=root)
