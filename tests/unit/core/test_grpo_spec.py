"""GRPO at the door (the spec alone; the API's checks of the prompts file and the grader are
tests/integration/test_api_jobs_grpo.py's): full fine-tuning on several GPUs (FSDP2) is accepted,
and ``grpo.log_rollouts`` is bounded."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.jobs.spec import JobSpec

TRAIN = "file-" + "1" * 24
GRADER = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
          "operation": "eq"}


def grpo_spec(**body: object) -> JobSpec:
    return JobSpec.model_validate({"model": "org/m", "training_file": TRAIN, "objective": "grpo",
                                   "grpo": {"graders": GRADER, **body.pop("grpo", {})}, **body})  # type: ignore[dict-item]


class TestGrpoSpec:
    def test_full_grpo_on_several_gpus_is_accepted_for_fsdp2(self) -> None:
        """Before, a sharded GRPO run was refused here ("runs on one GPU"): its rollouts now decode in
        lock-step across the FSDP2 ranks (trainer.objectives.grpo)."""
        spec = grpo_spec(method="full", gpus=2)
        assert (spec.method, spec.gpus, spec.objective) == ("full", 2, "grpo")

    def test_log_rollouts_defaults_to_4_and_is_bounded_naming_the_field(self) -> None:
        assert grpo_spec().grpo.log_rollouts == 4
        assert grpo_spec(grpo={"log_rollouts": 0}).grpo.log_rollouts == 0
        with pytest.raises(ValidationError) as info:
            grpo_spec(grpo={"log_rollouts": 65})
        [error] = info.value.errors()
        assert error["loc"] == ("grpo", "log_rollouts") and "less than or equal to 64" in error["msg"], error
