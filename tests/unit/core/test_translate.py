"""core.jobs.translate.to_train_config: the one spec -> TrainConfig mapping."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput
from core.jobs.spec import JobSpec
from core.jobs.translate import to_train_config
from trainer.config import SWITCHES, TrainConfig

TRAIN, VALID = "file-" + "1" * 24, "file-" + "2" * 24


def test_every_field_lands_where_the_trainer_reads_it() -> None:
    spec = JobSpec(
        model="org/m", training_file=TRAIN, validation_file=VALID, method="lora",
        lora={"r": 8, "alpha": 32, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
        hyperparameters={"max_steps": 50, "learning_rate": 1e-3, "lr_scheduler": "linear", "warmup_steps": 5,
                         "batch_tokens": 2048, "max_seq_len": 512, "grad_accum": 2, "seed": 7,
                         "weight_decay": 0.01, "max_grad_norm": 0.5},
        checkpoint_every=10, optimizations={"double_buffered_reload": "off"}, gpus=4,
    )
    config = to_train_config(spec, job_id="job-1", files={TRAIN: "/d/t.jsonl", VALID: "/d/v.jsonl"},
                             output_dir="/out/job-1", model_path="/models/m")
    assert config.model.name_or_path == "/models/m"
    assert (config.data.train_path, config.data.validation_path) == ("/d/t.jsonl", "/d/v.jsonl")
    assert (config.data.batch_tokens, config.data.max_seq_len) == (2048, 512)
    assert (config.optim.max_steps, config.optim.epochs, config.optim.learning_rate) == (50, None, 1e-3)
    assert (config.optim.lr_scheduler, config.optim.warmup_steps, config.optim.grad_accum) == ("linear", 5, 2)
    assert (config.optim.weight_decay, config.optim.max_grad_norm) == (0.01, 0.5)
    assert (config.lora.r, config.lora.alpha, config.lora.dropout) == (8, 32, 0.1)
    assert config.lora.target_modules == ("q_proj", "v_proj")
    assert config.optimizations.double_buffered_reload == "off"
    assert (config.seed, config.checkpoint_every, config.job_id, config.output_dir) == (7, 10, "job-1", "/out/job-1")
    assert (config.gpus, config.global_micro_batches) == (4, 8)  # each step: gpus x grad_accum micro-batches
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("value", ["on", "off"])
def test_every_switch_of_the_spec_reaches_the_trainer(value: str) -> None:
    spec = JobSpec(model="m/m", training_file=TRAIN, optimizations={name: value for name in SWITCHES})
    config = to_train_config(spec, job_id="j", files={TRAIN: "/t"}, output_dir="/o", model_path="m/m")
    assert {name: getattr(config.optimizations, name) for name in SWITCHES} == dict.fromkeys(SWITCHES, value)
    assert "offload_activations" in SWITCHES


def test_no_length_means_one_epoch() -> None:
    config = to_train_config(JobSpec(model="m/m", training_file=TRAIN), job_id="j", files={TRAIN: "/t"},
                             output_dir="/o", model_path="m/m")
    assert (config.optim.max_steps, config.optim.epochs) == (None, 1.0)
    assert config.data.validation_path is None


def test_missing_file_path_is_an_error() -> None:
    with pytest.raises(InvalidInput, match=TRAIN):
        to_train_config(JobSpec(model="m/m", training_file=TRAIN), job_id="j", files={}, output_dir="/o",
                        model_path="m/m")
