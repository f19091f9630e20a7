"""``core.evals.items`` and the eval checks of ``core.evals.service``: item schemas, the items of a
file, input templates and testing criteria, each refusal naming its line and field."""

from __future__ import annotations

import json

import pytest

from core.errors import InvalidDataset, InvalidInput
from core.evals.items import check_items, check_template, read_items, render_prompts, schema_errors
from core.evals.service import check_criteria, check_data_source_config

SCHEMA = {"type": "object", "required": ["question", "answer"], "additionalProperties": False,
          "properties": {"question": {"type": "string"}, "answer": {"type": ["string", "null"]},
                         "level": {"type": "integer", "enum": [1, 2, 3]},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


class TestSchema:
    @pytest.mark.parametrize(("item", "error"), [
        ({"question": "q", "answer": "a"}, None),
        ({"question": "q", "answer": None, "level": 2, "tags": ["x"]}, None),
        ({"question": "q"}, "item.answer: missing (the eval's item_schema requires it)"),
        ({"question": 3, "answer": "a"}, "item.question: expected string, got integer"),
        ({"question": "q", "answer": "a", "level": 4}, "item.level: 4 is not one of [1, 2, 3]"),
        ({"question": "q", "answer": "a", "level": True}, "item.level: expected integer, got boolean"),
        ({"question": "q", "answer": "a", "tags": ["x", 1]}, "item.tags[1]: expected string, got integer"),
        ({"question": "q", "answer": "a", "extra": 1}, "item.extra: not in the item_schema's properties "
                                                        "(additionalProperties is false)"),
    ])
    def test_the_first_difference_is_named_by_its_path(self, item, error):
        assert schema_errors(item, SCHEMA) == error

    def test_check_items_names_the_line(self):
        with pytest.raises(InvalidDataset) as caught:
            check_items([{"question": "q", "answer": "a"}, {"question": "q", "answer": 1}], SCHEMA,
                        "data_source.source.id")
        assert caught.value.line == 2 and caught.value.param == "data_source.source.id"
        assert str(caught.value).startswith("data_source.source.id: line 2: item.answer: expected string or null")

    def test_an_unknown_type_in_the_schema_is_refused_at_creation(self):
        with pytest.raises(InvalidInput) as caught:
            check_data_source_config({"type": "custom", "item_schema": {"type": "object", "properties": {
                "x": {"type": "str"}}}})
        assert caught.value.param == "data_source_config.item_schema.properties.x.type"
        with pytest.raises(InvalidInput) as caught:
            check_data_source_config({"type": "logs"})
        assert caught.value.param == "data_source_config.type"


class TestReadItems:
    def test_item_records_and_bare_objects_are_items_and_a_bad_line_is_named(self, tmp_path):
        path = tmp_path / "items.jsonl"
        path.write_text(json.dumps({"item": {"a": 1}, "sample": {}}) + "\n\n" + json.dumps({"a": 2}) + "\n")
        assert read_items(path, "file") == [{"a": 1}, {"a": 2}]
        path.write_text(json.dumps({"item": {"a": 1}}) + "\n" + "[1, 2]\n")
        with pytest.raises(InvalidDataset) as caught:
            read_items(path, "file")
        assert caught.value.line == 2 and "a JSON object is expected, got array" in str(caught.value)

    def test_a_line_that_is_not_utf8_is_named_not_a_server_error(self, tmp_path):
        """What schemathesis sent as an evals file (a PNG): a 422 naming the line, not a decode error."""
        path = tmp_path / "items.jsonl"
        path.write_bytes(json.dumps({"a": 1}).encode() + b"\n\x89PNG\r\n")
        with pytest.raises(InvalidDataset) as caught:
            read_items(path, "file")
        assert caught.value.line == 2 and "not UTF-8 (byte 0)" in str(caught.value)


class TestTemplate:
    def test_renders_item_fields_into_each_message_and_keeps_the_item(self):
        template = check_template([{"role": "system", "content": "Answer {{item.style}}."},
                                   {"role": "user", "content": {"type": "input_text", "text": "{{ item.q }}?"}}],
                                  "t")
        records = render_prompts(template, [{"q": "2+2", "style": "briefly"}, {"q": "3+3", "style": "in French"}],
                                 template_param="t", items_param="items")
        assert records[1] == {"messages": [{"role": "system", "content": "Answer in French."},
                                           {"role": "user", "content": "3+3?"}],
                              "item": {"q": "3+3", "style": "in French"}}

    def test_a_field_an_item_lacks_names_the_line_and_the_template(self):
        template = check_template([{"role": "user", "content": "{{item.q}} {{item.hint}}"}], "t")
        with pytest.raises(InvalidInput) as caught:
            render_prompts(template, [{"q": "a", "hint": "h"}, {"q": "b"}], template_param="t", items_param="items")
        assert caught.value.param == "t[0].content" and str(caught.value).startswith("items: line 2:")
        assert "hint" in str(caught.value)

    def test_the_sample_namespace_and_unknown_roles_are_refused(self):
        template = check_template([{"role": "user", "content": "{{ sample.output_text }}"}], "t")
        with pytest.raises(InvalidInput, match="item.* only"):
            render_prompts(template, [{"q": "a"}], template_param="t", items_param="items")
        with pytest.raises(InvalidInput) as caught:
            check_template([{"role": "robot", "content": "x"}], "t")
        assert caught.value.param == "t[0].role"


class TestCriteria:
    def test_a_python_grader_that_does_not_compile_is_named(self):
        with pytest.raises(InvalidInput) as caught:
            check_criteria([{"type": "string_check", "name": "a", "input": "x", "reference": "y", "operation": "eq"},
                            {"type": "python", "name": "b", "source": "def grade(sample, item) return 1"}])
        assert caught.value.param == "testing_criteria[1].source"

    def test_thresholds_are_kept_names_are_unique_and_model_graders_kept_for_their_judge(self):
        [python] = check_criteria([{"type": "python", "name": "p", "pass_threshold": 1,
                                    "source": "def grade(sample, item):\n    return 1.0\n"}])
        assert python["pass_threshold"] == 1.0
        same = {"type": "string_check", "name": "a", "input": "x", "reference": "y", "operation": "eq"}
        with pytest.raises(InvalidInput) as caught:
            check_criteria([same, same])
        assert caught.value.param == "testing_criteria[1].name"
        [judge] = check_criteria([{"type": "score_model", "name": "judge", "model": "tiny-llama",
                                   "input": [{"role": "user", "content": "{{sample.output_text}}"}]}])
        assert (judge["model"], judge["range"]) == ("tiny-llama", [0, 1])  # check_judges resolves the model
