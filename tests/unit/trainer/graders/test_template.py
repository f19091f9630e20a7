"""{{ item.x }} and {{ sample.output_text }} templates, as OpenAI renders them."""

from __future__ import annotations

import pytest

from trainer.graders.errors import GraderError
from trainer.graders.template import check_template, render, sample_namespace

ITEM = {"answer": "Paris", "facts": {"tags": ["a", "b"], "n": 3}, "odd-key": "x"}


def spaces(output: str) -> dict:
    return {"item": ITEM, "sample": sample_namespace(output)}


class TestRender:
    def test_item_and_sample_fields(self) -> None:
        text = "{{item.answer}} vs {{ sample.output_text }}; {{item.facts.tags[1]}} {{item.facts.n}} {{item.odd-key}}"
        assert render(text, spaces("Rome"), "p") == "Paris vs Rome; b 3 x"

    def test_a_non_string_value_is_compact_json(self) -> None:
        assert render("{{item.facts}}", spaces(""), "p") == '{"tags":["a","b"],"n":3}'

    def test_output_json_when_the_output_is_json(self) -> None:
        assert render("{{sample.output_json.city}}", spaces('{"city": "Paris"}'), "p") == "Paris"

    @pytest.mark.parametrize(("template", "says"), [
        ("{{item.missing}}", "item has no missing"), ("{{item.facts.tags[5]}}", r"item.facts.tags has no \[5\]"),
        ("{{sample.output_json.city}}", "output_text is not JSON"),
    ])
    def test_a_missing_field_is_an_error_naming_it(self, template: str, says: str) -> None:
        with pytest.raises(GraderError, match=says) as info:
            render(template, spaces("not json"), "grader.input")
        assert info.value.param == "grader.input"

    @pytest.mark.parametrize("template", ["{{ os.environ }}", "{{item..x}}", "{{ 1 + 1 }}"])
    def test_only_item_and_sample_paths_validate(self, template: str) -> None:
        with pytest.raises(GraderError, match="template"):
            check_template(f"a {template} b", "grader.reference")
