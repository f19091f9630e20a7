"""bench.product_path on the CPU: a saved tiny model and a JSONL through ``python -m trainer run``."""

from __future__ import annotations

import json

import pytest

from bench import product_path

pytestmark = pytest.mark.slow


class TestProductPath:
    def test_dataset_samples_have_the_drawn_token_counts(self, tmp_path) -> None:
        from transformers import AutoTokenizer

        model_dir = product_path.save_model(product_path.TINY, tmp_path / "model", "cpu")
        lengths = product_path.write_dataset(tmp_path / "train.jsonl", model_dir, 20)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
        counted = [len(tokenizer(r["text"])["input_ids"]) + 1 for r in records]  # + eos
        assert counted == lengths

    def test_a_tiny_cpu_run_reports_the_trainers_own_figures(self, tmp_path) -> None:
        out = tmp_path / "results.json"
        code = product_path.main(
            ["--device", "cpu", "--tiny", "--steps", "3", "--skip", "1", "--workdir", str(tmp_path), "--json", str(out)]
        )
        assert code == 0
        (result,) = json.loads(out.read_text())
        assert result["status"] == "ok" and result["steps_timed"] == 2
        assert result["tokens_per_s"] > 0 and len(result["losses"]) == 3
        assert {d["name"] for d in result["plan"]} >= {"attention", "loss", "parallelism"}

    def test_set_field_writes_a_dotted_path_as_json(self) -> None:
        job = {"optimizations": {}}
        product_path.set_field(job, "optimizations.offload_activations=on")
        product_path.set_field(job, "gradient_checkpointing=false")
        assert job == {"optimizations": {"offload_activations": "on"}, "gradient_checkpointing": False}
