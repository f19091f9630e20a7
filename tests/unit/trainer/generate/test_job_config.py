"""A generation job.json: torch-free (the worker and the API read it), strict about its fields."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.generate.job_config import GenerateConfig, is_generate_job

REPO = Path(__file__).resolve().parents[4]


def test_the_config_outputs_and_prompts_modules_import_no_torch() -> None:
    code = ("import sys; import trainer.generate.job_config, trainer.generate.outputs, trainer.generate.prompts; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_job_json_round_trips_and_is_told_from_a_training_one(tmp_path) -> None:
    config = GenerateConfig(model="m", prompts_file="p.jsonl", output_dir="out", sampling={"n": 2, "stop": ["x"]})
    config.save(tmp_path / "job.json")
    assert GenerateConfig.load(tmp_path / "job.json") == config
    assert is_generate_job(config.to_dict()) and not is_generate_job({"model": {}})


@pytest.mark.parametrize(("fields", "says"), [
    ({"sampling": {"beam": 2}}, "sampling: unknown field"),
    ({"slots": 0}, "slots: must be >= 1"),
    ({"device": "tpu"}, "device"),
    ({"kind": "train"}, "kind"),
])
def test_a_bad_field_is_refused_naming_it(fields, says) -> None:
    with pytest.raises(ValueError, match=says):
        GenerateConfig(model="m", prompts_file="p", output_dir="o", **fields)
