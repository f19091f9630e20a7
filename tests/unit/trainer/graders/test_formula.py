"""A multi grader's formula: arithmetic over grader names, nothing else reaches Python."""

from __future__ import annotations

import pytest

from trainer.graders.errors import GraderError
from trainer.graders.formula import evaluate, parse_formula

NAMES = {"exact", "fuzzy"}


def value(formula: str, **scores: float) -> float:
    return evaluate(parse_formula(formula, NAMES, "f"), scores, "f")


class TestFormula:
    @pytest.mark.parametrize(("formula", "expected"), [
        ("0.5 * exact + 0.5 * fuzzy", 0.6), ("(exact + fuzzy) / 2", 0.6), ("exact ^ 2 + fuzzy ** 2", 1.04),
        ("-exact + 2", 1.0), ("min(exact, fuzzy)", 0.2), ("max(exact, fuzzy, 0.5)", 1.0), ("abs(fuzzy - exact)", 0.8),
        ("floor(fuzzy * 10)", 2.0), ("ceil(fuzzy * 10) + 0", 2.0), ("sqrt(4) * exact", 2.0), ("exp(0) + log(1)", 1.0),
    ])
    def test_arithmetic_and_the_listed_functions(self, formula: str, expected: float) -> None:
        assert value(formula, exact=1.0, fuzzy=0.2) == pytest.approx(expected)

    @pytest.mark.parametrize(("formula", "says"), [
        ("__import__('os').system('id')", "only the functions"), ("exact.real", "Attribute"),
        ("exact if fuzzy else 0", "IfExp"), ("exact > fuzzy", "Compare"), ("other + 1", "'other' is not one of"),
        ("'a' + exact", "only numbers"), ("[exact][0]", "Subscript"), ("lambda: 1", "Lambda"), ("exact +", "does not parse"),
        ("exact % 2", "Mod"), ("max(exact, key=abs)", "positional"), ("True + exact", "only numbers"),
    ])
    def test_anything_else_is_refused_at_parse(self, formula: str, says: str) -> None:
        with pytest.raises(GraderError, match=says) as info:
            parse_formula(formula, NAMES, "grader.calculate_output")
        assert info.value.param == "grader.calculate_output"

    def test_a_math_error_is_a_grader_error_for_the_item(self) -> None:
        with pytest.raises(GraderError, match="ZeroDivisionError"):
            value("exact / fuzzy", exact=1.0, fuzzy=0.0)
        with pytest.raises(GraderError, match="OverflowError"):
            value("9 ^ 9 ^ 9", exact=1.0, fuzzy=0.0)
