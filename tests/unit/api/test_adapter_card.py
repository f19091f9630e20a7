"""api/jobs/card.py + artifacts.adapter_members: the adapter download names its base portably."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from api.jobs.artifacts import adapter_members
from api.jobs.card import AdapterCard, portable_base_name
from core.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    root = tmp_path / "models"
    (root / "team" / "llama-8b").mkdir(parents=True)
    (root / "team" / "llama-8b" / "config.json").write_text("{}")
    return Settings(data_dir=tmp_path / "data", model_root=root)


class TestPortableBaseName:
    def test_a_local_model_is_named_by_its_directory_under_the_model_root(self, settings: Settings) -> None:
        for spelled in ("team/llama-8b", str(settings.model_root / "team" / "llama-8b")):
            name, directory, kind = portable_base_name(SimpleNamespace(model=spelled), settings)
            assert (name, kind) == ("team/llama-8b", "local") and directory == settings.model_root / "team" / "llama-8b"

    def test_a_hub_id_stays_a_hub_id(self, settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        name, directory, kind = portable_base_name(SimpleNamespace(model="Qwen/Qwen3-0.6B"), settings)
        assert (name, directory, kind) == ("Qwen/Qwen3-0.6B", None, "hub")


def test_adapter_members_rewrite_the_base_add_the_card_and_the_tokenizer(tmp_path: Path) -> None:
    adapter, base = tmp_path / "adapter", tmp_path / "base"
    adapter.mkdir()
    base.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": "/srv/ftq/models/x"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"\0")
    (adapter / "README.md").write_text("peft's empty card")
    (base / "tokenizer.json").write_text("{}")
    (base / "chat_template.jinja").write_text("{{ messages }}")
    (base / "model.safetensors").write_bytes(b"\0")  # weights never ride along
    members = dict(adapter_members(adapter, AdapterCard("team/x", base, "local", "# card")))
    assert sorted(members) == ["README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
                               "tokenizer.json"]
    assert json.loads(members["adapter_config.json"]) == {"r": 8, "base_model_name_or_path": "team/x"}
    assert members["README.md"] == b"# card"
