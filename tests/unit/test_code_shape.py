"""The size and shape rules of the code base (issues 9 and 24): rooms small enough to hold in one's head.

No Python file outside ``trainer/kernels/`` (Triton kernels with their launchers and autograd
functions belong together) over ``MAX_FILE_LINES`` lines; no function in ``trainer/``, ``worker/``
or ``core/`` over ``MAX_FUNCTION_LINES`` lines (migrations are not in those packages); and no
import circle among the modules of ``trainer/``, ``worker/`` or ``core/``, counting imports made
inside functions (an import moved into a function hides a circle from Python, not from a reader).
A file or function that grows past them is cut on its seams, not exempted here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "bench", "cli", "core", "migrations", "tests", "trainer", "worker", "scripts")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
SHAPED = ("trainer", "worker", "core")
"""The packages whose functions are held to ``MAX_FUNCTION_LINES`` and whose imports form no circle."""


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

    def test_no_function_in_trainer_worker_or_core_is_over_60_lines(self) -> None:
        too_long = []
        for path in (p for package in SHAPED for p in _python_files(package)):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
        assert not too_long, f"over {MAX_FUNCTION_LINES} lines: {too_long}"

    def test_no_import_circle_in_trainer_worker_or_core(self) -> None:
        graph = import_graph(ROOT, SHAPED)
        circles = [" -> ".join(sorted(c)) for c in circles_of(graph)]
        assert not circles, f"import circles (function-level imports included): {circles}"

    def test_the_circle_finder_sees_a_circle_hidden_in_a_function(self, tmp_path: Path) -> None:
        (tmp_path / "pkg").mkdir()
        (tmp_path / "pkg" / "__init__.py").write_text("")
        (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
        (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg.c import g\n")
        (tmp_path / "pkg" / "c.py").write_text("from . import a\n")
        (tmp_path / "pkg" / "d.py").write_text("import pkg.a\n")
        assert [sorted(c) for c in circles_of(import_graph(tmp_path, ("pkg",)))] == [["pkg.a", "pkg.b", "pkg.c"]]

    def test_the_rules_see_the_code(self) -> None:
        files = [p for package in PACKAGES for p in _python_files(package)]
        assert len(files) > 100 and ROOT / "trainer" / "training" / "train.py" in files


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules an import statement reaches: ``from p import x`` reaches ``p.x`` where that is a
    module, else ``p``; a name outside ``modules`` reaches its nearest enclosing module there."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
    else:
        return []
    reached = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module:
            reached.append(name)
    return reached


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its file (functions included).

    Importing a package's submodule does not count as importing the package's ``__init__``.
    """
    files = {_module_name(root, p): p for package in packages for p in sorted((root / package).rglob("*.py"))
             if "__pycache__" not in p.parts}
    modules = set(files)
    return {
        module: {reached for node in ast.walk(ast.parse(path.read_text()))
                 for reached in _imported(node, module, path.name == "__init__.py", modules)}
        for module, path in files.items()
    }


def circles_of(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found
