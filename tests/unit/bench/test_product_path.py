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

    def test_set_field_writes_a_dotted_path_as_json(self) -> None:
        job = {"optimizations": {}}
        product_path.set_field(job, "optimizations.offload_activations=on")
        product_path.set_field(job, "gradient_checkpointing=false")
        assert job == {"optimizations": {"offload_activations": "on"}, "gradient_checkpointing": False}

    def test_tiny_cpu_runs_report_the_trainers_own_figures_and_a_variants_ratio(self, tmp_path, capsys) -> None:
        out = tmp_path / "results.json"
        code = product_path.main(
            ["--device", "cpu", "--tiny", "--steps", "2", "--skip", "1", "--workdir", str(tmp_path), "--json",
             str(out), "--variant", "no-cache:optimizations.packed_metadata_cache=off"]
        )
        assert code == 0
        base, variant = json.loads(out.read_text())
        assert (base["label"], variant["label"]) == ("auto", "no-cache")
        assert base["status"] == "ok" and base["steps_timed"] == 1
        assert base["tokens_per_s"] > 0 and len(base["losses"]) == 2
        assert {d["name"] for d in base["plan"]} >= {"attention", "loss", "parallelism"}
        cache = {d["name"]: d for d in variant["plan"]}["packed_metadata_cache"]
        assert cache["enabled"] is False
        printed = capsys.readouterr().out
        assert "| tiny-Llama | no-cache |" in printed and "vs auto" in printed

    def test_parse_variant_refuses_a_spec_without_fields(self) -> None:
        assert product_path.parse_variant("x:a=1,b=2", ["c=3"]) == ("x", ["c=3", "a=1", "b=2"])
        with pytest.raises(SystemExit, match="LABEL:FIELD=VALUE"):
            product_path.parse_variant("x", [])
