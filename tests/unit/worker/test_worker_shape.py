"""worker/'s shape (issue 24): no import circle among its modules, no function over 60 lines.

Every import counts, at module level, inside a function or under ``TYPE_CHECKING``: a circle
hidden in a function still ties the modules' meanings together.
"""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[3] / "worker"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(WORKER.rglob("*.py")):
        parts = path.relative_to(WORKER.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The worker modules ``name`` imports (``from worker import nodes`` names ``worker.nodes``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    resolved = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


class TestWorkerShape:
    def test_no_import_circle_among_the_worker_modules(self) -> None:
        modules = _modules()
        graph = {name: _imports(name, path, modules) for name, path in modules.items()}
        assert "worker.executors.local" in graph and "worker.runner" in graph["worker.tasks"]
        assert not _circles(graph)

    def test_the_circle_finder_sees_a_circle(self) -> None:
        assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

    def test_no_worker_function_is_over_60_lines(self) -> None:
        too_long = [
            f"{path.relative_to(WORKER.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path in _modules().values()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        ]
        assert not too_long, f"over {MAX_FUNCTION_LINES} lines (cut on a seam): {too_long}"
