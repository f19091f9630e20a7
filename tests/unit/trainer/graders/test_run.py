"""grade(): each grader type end to end on one output, a multi grader's sub-scores, and a
failure inside a grader kept to its item with OpenAI's error flag."""

from __future__ import annotations

import pytest

from trainer.graders import ERROR_FLAGS, SandboxLimits, grade, uses_model, validate
from trainer.graders.errors import GraderError

LIMITS = SandboxLimits(cpu_s=1, wall_s=3.0, memory_bytes=256 << 20)
EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "operation": "eq"}
CLOSE = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "evaluation_metric": "rouge_1"}
PYTHON = {"type": "python", "name": "length",
          "source": "def grade(sample, item):\n    return min(1.0, len(sample['output_text']) / 10)\n"}


def run(grader: dict, output: str, item: dict | None = None):
    return grade(validate(grader), output, item if item is not None else {"answer": "Paris is big"}, limits=LIMITS)


class TestGrade:
    def test_string_check(self) -> None:
        assert run(EXACT, "Paris is big").score == 1.0 and run(EXACT, "Paris").score == 0.0

    def test_text_similarity(self) -> None:
        # rouge_1 F: 2 of 2 predicted, 2 of 3 expected: 2 * 1 * (2/3) / (1 + 2/3) = 0.8
        assert run(CLOSE, "Paris big").score == pytest.approx(0.8)

    def test_python(self) -> None:
        result = run(PYTHON, "Paris")
        assert (result.score, result.ok, result.type) == (0.5, True, "python")

    def test_multi_combines_named_scores(self) -> None:
        multi = {"type": "multi", "name": "mix", "graders": {"exact": EXACT, "close": CLOSE, "length": PYTHON},
                 "calculate_output": "(exact + close + length) / 3"}
        result = run(multi, "Paris big")
        assert result.sub_scores == pytest.approx({"exact": 0.0, "close": 0.8, "length": 0.9})
        assert result.score == pytest.approx(1.7 / 3)

    def test_a_python_failure_is_that_items_error(self) -> None:
        result = run({**PYTHON, "source": "def grade(sample, item):\n    return open('/etc/passwd').read()\n"}, "x")
        assert result.score == 0.0 and not result.ok
        assert [flag for flag in ERROR_FLAGS if result.errors[flag]] == ["python_grader_runtime_error"]
        assert result.error.startswith("python grader 'length': open('/etc/passwd') is not allowed")

    def test_a_limit_is_a_server_error_flag(self) -> None:
        result = run({**PYTHON, "source": "def grade(sample, item):\n    while True:\n        pass\n"}, "x")
        assert result.errors["python_grader_server_error"] and result.error_type in ("cpu", "wall")

    def test_a_multi_with_a_failing_grader_fails_with_its_flag(self) -> None:
        multi = {"type": "multi", "name": "mix", "calculate_output": "exact + broken",
                 "graders": {"exact": EXACT, "broken": {**PYTHON, "source": "def grade(s, i):\n    return 1 / 0\n"}}}
        result = run(multi, "Paris is big")
        assert result.score == 0.0 and result.errors["python_grader_runtime_error"]
        assert result.sub_scores == {"exact": 1.0, "broken": 0.0}

    def test_a_formula_error_is_flagged(self) -> None:
        multi = {"type": "multi", "name": "mix", "graders": {"exact": EXACT}, "calculate_output": "1 / exact"}
        result = run(multi, "nope")
        assert result.errors["formula_parse_error"] and "ZeroDivisionError" in result.error

    def test_a_template_naming_a_missing_field_raises(self) -> None:
        with pytest.raises(GraderError, match="item has no answer") as info:
            run(EXACT, "x", {"question": "?"})
        assert info.value.param == "grader.reference"

    def test_uses_model(self) -> None:
        label = {"type": "label_model", "name": "t", "model": "m", "labels": ["a"], "passing_labels": ["a"],
                 "input": [{"role": "user", "content": "x"}]}
        assert uses_model(validate(label))
        assert uses_model(validate({"type": "multi", "name": "m", "graders": {"t": label}, "calculate_output": "t"}))
        assert not uses_model(validate(EXACT))
