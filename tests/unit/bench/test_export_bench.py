"""bench.export on the CPU: the 8B bench's set-up and measurement on the tiny shape, for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.export import build_config, main


def test_the_8b_shape_is_llama_3_1_8b_with_its_rope_scaling() -> None:
    config = build_config("llama-8b")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size) == (
        4096, 32, 14336, 128256)
    assert config.rope_parameters["rope_type"] == "llama3"


# peft 0.21 reads transformers' deprecated is_gradient_checkpointing when it wraps the base
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.slow
def test_the_tiny_shape_runs_the_export_path_and_prints_the_table(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--work", str(tmp_path / "work"),
                 "--variants", "gguf-q8_0-cpu,merged-cuda", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]  # the -cuda variant is dropped on the CPU
    assert row["variant"] == "gguf-q8_0-cpu" and row["bytes"] > 0 and row["host_rss_peak"] > 0
    assert row["gpu_mem_peak"] is None
    table = capsys.readouterr().out
    assert "| variant | wall s | export s | peak GPU GiB | peak host RSS GiB | output GiB |" in table
    assert "| gguf-q8_0-cpu |" in table
    assert not (tmp_path / "work" / "out" / "gguf-q8_0-cpu").exists(), "each variant's output is removed"
