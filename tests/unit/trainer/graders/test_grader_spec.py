"""A malformed grader is refused at validation, naming the field; a good one comes back with defaults."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.graders.errors import GraderError
from trainer.graders.spec import validate

CHECK = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
         "operation": "eq"}
SIMILAR = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
           "reference": "{{item.answer}}", "evaluation_metric": "rouge_l"}
PYTHON = {"type": "python", "name": "py", "source": "def grade(sample, item):\n    return 1.0\n"}
SCORE = {"type": "score_model", "name": "judge", "model": "tiny",
         "input": [{"role": "system", "content": "Rate it."},
                   {"role": "user", "content": [{"type": "input_text", "text": "{{sample.output_text}}"}]}]}
LABEL = {"type": "label_model", "name": "tone", "model": "tiny", "labels": ["polite", "rude"],
         "passing_labels": ["polite"], "input": [{"role": "user", "content": "{{sample.output_text}}"}]}
MULTI = {"type": "multi", "name": "both", "graders": {"exact": CHECK, "close": SIMILAR},
         "calculate_output": "0.5 * exact + 0.5 * close"}


def refused(grader: Any) -> GraderError:
    with pytest.raises(GraderError) as info:
        validate(grader)
    return info.value


class TestValid:
    @pytest.mark.parametrize("grader", [CHECK, SIMILAR, PYTHON, MULTI], ids=lambda g: g["type"])
    def test_each_type_validates_as_sent(self, grader: dict) -> None:
        assert validate(grader) == grader

    def test_label_model_gets_empty_sampling_params(self) -> None:
        assert validate(LABEL) == {**LABEL, "sampling_params": {}}

    def test_score_model_gets_its_default_range(self) -> None:
        checked = validate(SCORE)
        assert checked["range"] == [0.0, 1.0] and checked["sampling_params"] == {}
        assert checked["input"][1]["content"] == "{{sample.output_text}}"

    def test_a_single_grader_in_multi_is_known_by_its_name(self) -> None:
        checked = validate({**MULTI, "graders": CHECK, "calculate_output": "exact * 2"})
        assert list(checked["graders"]) == ["exact"]


class TestRefused:
    @pytest.mark.parametrize(("grader", "param", "says"), [
        ({**CHECK, "operation": "contains"}, "grader.operation", "must be one of eq, ne, like, ilike"),
        ({**CHECK, "type": "regex"}, "grader.type", "must be one of string_check"),
        ({k: v for k, v in CHECK.items() if k != "reference"}, "grader.reference", "missing"),
        ({**CHECK, "extra": 1}, "grader.extra", "unknown field"),
        ({**CHECK, "input": 3}, "grader.input", "must be a string"),
        ({**CHECK, "name": " "}, "grader.name", "must not be empty"),
        ({**CHECK, "input": "{{ answer }}"}, "grader.input", "must start with item. or sample."),
        ({**SIMILAR, "evaluation_metric": "meteor"}, "grader.evaluation_metric", "'meteor' is not supported by ftq"),
        ({**SIMILAR, "evaluation_metric": "cosine"}, "grader.evaluation_metric", "embedding model"),
        ({**SIMILAR, "evaluation_metric": "rouge_9"}, "grader.evaluation_metric", "must be one of fuzzy_match"),
        ({**PYTHON, "source": "def grade(:\n"}, "grader.source", "does not compile: line 1"),
        ({**PYTHON, "source": "def score(sample, item):\n    return 1\n"}, "grader.source", "grade(sample, item)"),
        ({**PYTHON, "image_tag": "2025-05-08"}, "grader.image_tag", "leave image_tag out"),
        ({**SCORE, "range": [1, 0]}, "grader.range", "low must be below high"),
        ({**SCORE, "input": []}, "grader.input", "non-empty list"),
        ({**SCORE, "input": [{"role": "robot", "content": "x"}]}, "grader.input[0].role", "must be one of user"),
        ({**SCORE, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "grader.input[0].content[0]", "only text content"),
        ({**SCORE, "sampling_params": {"temperature": -1}}, "grader.sampling_params.temperature", "out of range"),
        ({**SCORE, "sampling_params": {"max_completions_tokens": 0}}, "grader.sampling_params.max_completions_tokens",
         "integer >= 1"),
        ({**SCORE, "model": ""}, "grader.model", "must name a model"),
        ({**LABEL, "passing_labels": ["kind"]}, "grader.passing_labels", "'kind' is not one of labels"),
        ({**LABEL, "labels": []}, "grader.labels", "non-empty list"),
        ({**MULTI, "calculate_output": "exact + fuzzy"}, "grader.calculate_output", "'fuzzy' is not one of"),
        ({**MULTI, "graders": {"exact": {**CHECK, "operation": "is"}}}, "grader.graders.exact.operation",
         "must be one of"),
        ({**MULTI, "graders": {"a-b": CHECK}}, "grader.graders.a-b", "a name the formula can use"),
        ({**MULTI, "graders": {"inner": MULTI}}, "grader.graders.inner.type", "cannot nest"),
        ("string_check", "grader", "must be an object"),
    ])
    def test_the_bad_field_is_named(self, grader: Any, param: str, says: str) -> None:
        error = refused(grader)
        assert error.param == param
        assert says in error.message and error.message.startswith(param)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children,
                                                                                       max_size=4), max_leaves=12)
FIELDS = st.sampled_from(["type", "name", "input", "reference", "operation", "evaluation_metric", "source", "model",
                          "labels", "passing_labels", "range", "sampling_params", "graders", "calculate_output"])


class TestAnyInput:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(base=st.sampled_from([CHECK, SIMILAR, PYTHON, SCORE, LABEL, MULTI]), field=FIELDS, value=JSON)
    def test_anything_is_a_grader_or_a_grader_error(self, base: dict, field: str, value: Any) -> None:
        try:
            validate({**base, field: value})
        except GraderError as error:
            assert error.param and error.message.startswith(error.param.split("[")[0].split(".")[0])
