"""The size rules of the code base (issue 9): rooms small enough to hold in one's head.

No Python file outside ``trainer/kernels/`` (Triton kernels with their launchers and autograd
functions belong together) over ``MAX_FILE_LINES`` lines, and no function in ``trainer/`` over
``MAX_FUNCTION_LINES`` lines. A file or function that grows past them is cut on its seams, not
exempted here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "bench", "cli", "core", "migrations", "tests", "trainer", "worker", "scripts")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


class TestCodeShape:
    def test_no_python_file_outside_the_kernels_is_over_500_lines(self) -> None:
        too_long = [
            f"{path.relative_to(ROOT)}: {lines} lines"
            for package in PACKAGES
            for path in _python_files(package)
            if (ROOT / "trainer" / "kernels") not in path.parents
            and (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
        ]
        assert not too_long, f"over {MAX_FILE_LINES} lines (cut on a seam): {too_long}"

    def test_no_trainer_function_is_over_60_lines(self) -> None:
        too_long = []
        for path in _python_files("trainer"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
        assert not too_long, f"over {MAX_FUNCTION_LINES} lines: {too_long}"

    def test_the_rules_see_the_code(self) -> None:
        files = [p for package in PACKAGES for p in _python_files(package)]
        assert len(files) > 100 and ROOT / "trainer" / "training" / "train.py" in files
