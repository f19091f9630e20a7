"""TrainConfig: JSON round trip, errors that name the field, and no torch on import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from trainer_helpers import REPO_ROOT

from trainer.config import DataConfig, ModelConfig, OptimConfig, TrainConfig


def _config(**kw: object) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig("m"),
        data=DataConfig("t.jsonl"),
        optim=OptimConfig(max_steps=3),
        output_dir="o",
        **kw,
    )


class TestTrainConfig:
    def test_round_trip_through_json_file(self, tmp_path):
        config = _config(seed=7, checkpoint_every=2)
        config.save(tmp_path / "job.json")
        assert TrainConfig.load(tmp_path / "job.json") == config

    def test_unknown_nested_field_is_named(self):
        raw = _config().to_dict()
        raw["optim"]["lr"] = 1e-3
        with pytest.raises(ValueError, match=r"optim\.lr: unknown field"):
            TrainConfig.from_dict(raw)

    def test_both_steps_and_epochs_is_refused(self):
        with pytest.raises(ValueError, match="exactly one of max_steps and epochs"):
            OptimConfig(max_steps=3, epochs=1.0)

    def test_batch_tokens_below_max_seq_len_is_refused(self):
        with pytest.raises(
            ValueError, match=r"data\.batch_tokens \(64\) must be >= data\.max_seq_len"
        ):
            DataConfig("t.jsonl", max_seq_len=128, batch_tokens=64)

    def test_importing_what_the_worker_uses_loads_no_torch(self):
        code = (
            "import trainer, trainer.config, trainer.events, trainer.training.layout, sys; "
            "assert 'torch' not in sys.modules, 'torch imported'"
        )
        subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
