"""A multi grader's ``calculate_output``: arithmetic over its graders' scores, parsed with ``ast``.

What OpenAI's guide lists and nothing else: numbers, the graders' names, ``+ - * /``, ``^`` (and
``**``) for power, parentheses, unary minus, and the functions ``min``, ``max``, ``abs``,
``floor``, ``ceil``, ``exp``, ``sqrt``, ``log``. The formula is parsed into a tree once at
validation and evaluated by walking it: no ``eval``, no attribute, subscript, comparison or call
of anything else, so a formula cannot reach Python.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from trainer.graders.errors import GraderError

FUNCTIONS: dict[str, Any] = {"min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil,
                             "exp": math.exp, "sqrt": math.sqrt, "log": math.log}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}
_MAX_CHARS = 1000


def parse_formula(formula: str, names: set[str], param: str) -> ast.Expression:
    """The formula's tree; raises ``GraderError`` naming what is not allowed."""
    if len(formula) > _MAX_CHARS:
        raise GraderError(f"{param}: longer than {_MAX_CHARS} characters", param)
    try:
        # ``^`` is power, with power's precedence: rewritten before parsing (Python's ``^`` binds looser than +)
        tree = ast.parse(formula.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise GraderError(f"{param}: does not parse: {exc.msg} (column {exc.offset})", param) from None
    for node in ast.walk(tree):
        _check(node, names, param)
    return tree


def _check(node: ast.AST, names: set[str], param: str) -> None:
    if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop)):
        if isinstance(node, ast.operator) and type(node) not in _BINARY:
            raise GraderError(f"{param}: operator {type(node).__name__} is not allowed; use + - * / ^", param)
        if isinstance(node, ast.unaryop) and not isinstance(node, (ast.USub, ast.UAdd)):
            raise GraderError(f"{param}: operator {type(node).__name__} is not allowed", param)
        return
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise GraderError(f"{param}: only numbers may appear as constants (got {node.value!r})", param)
    elif isinstance(node, ast.Name):
        if node.id not in names and node.id not in FUNCTIONS:
            raise GraderError(f"{param}: {node.id!r} is not one of the graders ({', '.join(sorted(names))})", param)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise GraderError(f"{param}: only the functions {', '.join(FUNCTIONS)} may be called", param)
        if node.keywords or not node.args:
            raise GraderError(f"{param}: {node.func.id}() takes positional arguments", param)
    elif not isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise GraderError(f"{param}: {type(node).__name__} is not allowed: only arithmetic over grader names", param)


def evaluate(tree: ast.Expression, scores: dict[str, float], param: str) -> float:
    """The formula's value for these scores; a math error (division by zero) raises ``GraderError``."""
    try:
        value = float(_value(tree.body, scores))
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise GraderError(f"{param}: {type(exc).__name__}: {exc}", param) from None
    if not math.isfinite(value):
        raise GraderError(f"{param}: the result is not a finite number ({value})", param)
    return value


def _value(node: ast.AST, scores: dict[str, float]) -> Any:
    if isinstance(node, ast.Constant):
        return float(node.value)  # float powers overflow at once; an int power (9 ^ 9 ^ 9) would run for hours
    if isinstance(node, ast.Name):
        if node.id not in scores:
            raise ValueError(f"{node.id} is a function, not a score")
        return scores[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand, scores)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_value(node.left, scores), _value(node.right, scores))
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), ast.dump(node)
    return FUNCTIONS[node.func.id](*(_value(arg, scores) for arg in node.args))
