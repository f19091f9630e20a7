"""core.graders.service: graders' errors become InvalidInput naming the field; model graders are
validated but not run in the API; the settings' limits reach the sandbox."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput
from core.graders import service
from core.settings import Settings

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "operation": "eq"}
LABEL = {"type": "label_model", "name": "tone", "model": "tiny", "labels": ["ok", "bad"], "passing_labels": ["ok"],
         "input": [{"role": "user", "content": "{{sample.output_text}}"}]}


class TestService:
    def test_a_malformed_grader_is_invalid_input_naming_the_field(self) -> None:
        with pytest.raises(InvalidInput) as info:
            service.check({**EXACT, "operation": "equals"})
        assert info.value.param == "grader.operation"
        assert info.value.message.startswith("grader.operation: must be one of eq, ne, like, ilike")

    def test_a_missing_item_field_is_invalid_input(self) -> None:
        with pytest.raises(InvalidInput) as info:
            service.run(EXACT, "Paris", {"question": "?"}, Settings())
        assert info.value.param == "grader.reference" and "item has no answer" in info.value.message

    def test_model_graders_validate_but_do_not_run_here(self) -> None:
        assert service.check(LABEL)["type"] == "label_model"
        with pytest.raises(InvalidInput, match="need a judge model loaded on a GPU worker") as info:
            service.run(LABEL, "hi", {}, Settings())
        assert info.value.param == "grader.type"

    def test_the_settings_limits_reach_the_sandbox(self) -> None:
        settings = Settings(grader_cpu_s=2, grader_wall_s=1.5, grader_memory_mib=128)
        limits = service.limits_of(settings)
        assert (limits.cpu_s, limits.wall_s, limits.memory_bytes) == (2, 1.5, 128 << 20)
        sleeper = {"type": "python", "name": "slow", "source": "import time\ndef grade(s, i):\n    time.sleep(30)\n"}
        _, result = service.run(sleeper, "x", {}, settings)
        assert result.error_type == "wall" and "1.5 s" in result.error
