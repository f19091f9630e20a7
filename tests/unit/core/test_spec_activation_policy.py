"""The job spec's activation-policy fields: accepted values, old booleans, refusals naming the
field, and where they land in the trainer's config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.jobs.spec import JobSpec
from core.jobs.translate import to_train_config

TRAIN = "file-" + "1" * 24


def _spec(**fields: object) -> JobSpec:
    return JobSpec(model="org/m", training_file=TRAIN, **fields)


class TestActivationPolicyFields:
    def test_defaults_are_auto_and_no_cap(self) -> None:
        stored = _spec().to_stored()
        assert (stored["gradient_checkpointing"], stored["max_gpu_memory_gb"]) == ("auto", None)

    @pytest.mark.parametrize(("given", "read"), [(True, "on"), (False, "off"), ("selective", "selective")])
    def test_values_and_old_booleans(self, given: object, read: str) -> None:
        assert _spec(gradient_checkpointing=given).gradient_checkpointing == read

    @pytest.mark.parametrize(
        ("field", "value"), [("gradient_checkpointing", "partial"), ("max_gpu_memory_gb", 0), ("max_gpu_memory_gb", -2)]
    )
    def test_bad_values_name_the_field(self, field: str, value: object) -> None:
        with pytest.raises(ValidationError) as caught:
            _spec(**{field: value})
        assert caught.value.errors()[0]["loc"] == (field,)

    def test_they_reach_the_trainer(self) -> None:
        config = to_train_config(
            _spec(gradient_checkpointing="selective", max_gpu_memory_gb=40.5), job_id="job-1",
            files={TRAIN: "/d/t.jsonl"}, output_dir="/out", model_path="/models/m",
        )
        assert (config.gradient_checkpointing, config.max_gpu_memory_gb) == ("selective", 40.5)
