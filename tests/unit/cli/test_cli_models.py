"""``ftq models``: the model root's models as a table (``GET /v1/models``), with LoRA / full fits."""

from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from cli import models
from cli.main import main


def listed(name: str, lora: dict, full: dict, **fields) -> dict:
    return {"id": name, "object": "model", "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "bytes": 1_420_000_000, "params": 596_049_920, "error": None, "fit": {"lora": lora, "full": full}, **fields}


def fits(gpus: int) -> dict:
    return {"fits": True, "gpus": gpus, "peak_bytes": 1, "reason": "ok"}


NO = {"fits": False, "gpus": None, "peak_bytes": 2, "reason": "not on 8 GPUs of box (the closest): est. 160.0 GiB"}
UNKNOWN = {"fits": None, "gpus": None, "peak_bytes": None, "reason": "no live worker has a GPU to fit against"}


class TestFormatModels:
    def test_a_table_with_size_architecture_parameters_and_fits_then_the_reasons(self) -> None:
        text = models.format_models([
            listed("Qwen/Qwen3-0.6B", fits(1), fits(1)),
            listed("meta/Llama-70B", fits(4), NO, bytes=141_000_000_000, params=70_553_706_496),
            listed("tiny", UNKNOWN, UNKNOWN, bytes=584_700, params=134_000, error="config.json has no model_type"),
        ], "/models")

        assert text.splitlines() == [
            "NAME             SIZE      ARCHITECTURE      PARAMS  LORA          FULL",
            "Qwen/Qwen3-0.6B  1.4 GB    LlamaForCausalLM  596.0M  yes           yes",
            "meta/Llama-70B   141.0 GB  LlamaForCausalLM  70.6B   yes (4 GPUs)  no",
            "tiny             584.7 KB  LlamaForCausalLM  134.0K  ?             ?",
            "meta/Llama-70B full: not on 8 GPUs of box (the closest): est. 160.0 GiB",
            "tiny: warning: config.json has no model_type",
            "?: no live worker has a GPU to fit against",
        ]

    def test_an_empty_root_says_how_to_pull_a_model(self) -> None:
        assert models.format_models([], "/srv/models") == "no models under /srv/models; pull one with `ftq models pull ORG/NAME`"


def test_ftq_models_lists_the_model_root_through_the_api(
    api: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models, "connect", lambda: contextlib.nullcontext(api))

    assert main(["models"]) == 0

    header, row, *notes = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "SIZE", "ARCHITECTURE", "PARAMS", "LORA", "FULL"]
    name, size, unit, architecture, params, lora, full = row.split()
    assert (name, unit, architecture, lora, full) == ("tiny", "KB", "LlamaForCausalLM", "?", "?")
    assert float(size) > 100 and params.endswith("K")
    assert notes == ["?: no live worker has a GPU to fit against; start one with `ftq worker --gpus all`"]


class TestHubToken:
    def test_hf_token_wins_then_the_config_files_hf_token_which_saving_keeps(
        self, tmp_path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from cli import config

        monkeypatch.setenv("FTQ_CONFIG", str(tmp_path / "config.toml"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        assert models.hub_token() is None
        (tmp_path / "config.toml").write_text('api_key = "ftq_k"\nhf_token = "hf_from_file"\n')
        config.remember_api_url("http://box:8000")  # every `ftq up` rewrites the file
        assert models.hub_token() == "hf_from_file"
        monkeypatch.setenv("HF_TOKEN", "hf_from_env")
        assert models.hub_token() == "hf_from_env"
