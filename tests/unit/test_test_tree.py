"""The test tree's own rules (issue 24 item 6), read from the source with ``ast``:

- no test module (``test_*.py``) imports another test module or a ``conftest.py``: what tests
  share lives in tests/fixtures/ (plain helpers, and fixture plugins) or in the nearest conftest;
- no fixture is defined twice, in two conftests (or a conftest and a plugin of tests/fixtures/),
  with the same body (to the letter, or, for a body of five statements or more, alike but for its
  strings and numbers): a fixture two folders need is defined once, in the conftest above both or
  in a plugin of tests/fixtures/.

Each check is also run on a small tree written here that breaks it, so it is known to fail.
"""

from __future__ import annotations

import ast
import copy
from itertools import combinations
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHAPE_MIN_STATEMENTS = 5


def _module_name(path: Path, root: Path) -> str:
    return ".".join((root.name, *path.relative_to(root).with_suffix("").parts))


def _imported(tree: ast.Module, module: str) -> set[str]:
    """Every module an ``import`` anywhere in the file names (function-level ones too), with
    ``from X import y`` giving both ``X`` and ``X.y`` (y may be a module)."""
    package = module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imports_between_test_modules(root: Path) -> list[str]:
    """``file imports module`` for each test module of ``root`` that imports a test module or a
    conftest of ``root``."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    # a folder put on sys.path makes its test modules importable by their bare names too
    modules.update({p.stem: p for p in root.rglob("test_*.py") if p.stem not in modules})
    found = []
    for path in sorted(root.rglob("test_*.py")):
        name = _module_name(path, root)
        for imported in sorted(_imported(ast.parse(path.read_text()), name)):
            target = modules.get(imported)
            if target is not None and target != path and (target.name.startswith("test_") or target.name == "conftest.py"):
                found.append(f"{path.relative_to(root)} imports {imported}")
    return found


def _is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "fixture") or (
        isinstance(target, ast.Name) and target.id == "fixture")


def _fixture_bodies(path: Path) -> dict[str, list[ast.stmt]]:
    bodies = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and any(_is_fixture(d) for d in node.decorator_list):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            bodies[node.name] = body
    return bodies


def _dump(body: list[ast.stmt], *, values: bool) -> str:
    shape = ast.Module(body=copy.deepcopy(body), type_ignores=[])
    if not values:
        for node in ast.walk(shape):
            if isinstance(node, ast.Constant):
                node.value = None
    return ast.dump(shape)


def duplicated_fixtures(root: Path) -> list[str]:
    """``a::x ~ b::y`` for each fixture of one conftest (or plugin of ``root/fixtures``) of ``root``
    whose body a fixture of another one repeats."""
    homes = sorted([*root.rglob("conftest.py"), *(root / "fixtures").glob("*.py")])
    fixtures = [(path.relative_to(root), name, body) for path in homes for name, body in _fixture_bodies(path).items()]
    found = []
    for (path_a, name_a, body_a), (path_b, name_b, body_b) in combinations(fixtures, 2):
        if path_a == path_b:
            continue
        statements = sum(isinstance(n, ast.stmt) for stmt in body_a for n in ast.walk(stmt))
        same = _dump(body_a, values=True) == _dump(body_b, values=True)
        alike = statements >= SHAPE_MIN_STATEMENTS and _dump(body_a, values=False) == _dump(body_b, values=False)
        if same or alike:
            found.append(f"{path_a}::{name_a} ~ {path_b}::{name_b}")
    return found


def test_no_test_module_imports_another_or_a_conftest() -> None:
    assert imports_between_test_modules(TESTS) == [], "move what they share to tests/fixtures/ (tests/fixtures/README.md)"


def test_no_fixture_is_copied_between_conftests() -> None:
    assert duplicated_fixtures(TESTS) == [], "define it once: the conftest above both, or a tests/fixtures plugin"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_import_check_finds_each_way_of_importing_a_test_module(tmp_path: Path) -> None:
    root = _write(tmp_path / "tests", {
        "a/test_one.py": "def helper(): ...\n",
        "a/conftest.py": "X = 1\n",
        "a/test_two.py": "from tests.a.test_one import helper\n",
        "a/test_three.py": "def test_x():\n    import tests.a.test_one\n",
        "a/test_four.py": "from tests.a import test_one\n",
        "a/test_five.py": "from .test_one import helper\n",
        "a/test_six.py": "from tests.a.conftest import X\n",
        "a/test_fine.py": "from tests.fixtures.things import helper\nimport os\n",
        "fixtures/things.py": "def helper(): ...\n",
    })
    assert imports_between_test_modules(root) == [
        "a/test_five.py imports tests.a.test_one",
        "a/test_four.py imports tests.a.test_one",
        "a/test_six.py imports tests.a.conftest",
        "a/test_three.py imports tests.a.test_one",
        "a/test_two.py imports tests.a.test_one",
    ]


def test_the_fixture_check_finds_copies_to_the_letter_and_alike_but_for_values(tmp_path: Path) -> None:
    loop = ("    rng = random.Random(0)\n    path = tmp.mktemp({dir!r}) / 'train.jsonl'\n"
            "    with path.open('w') as f:\n        for _ in range({n}):\n            f.write(str(rng.random()))\n"
            "    return path\n")
    root = _write(tmp_path / "tests", {
        "conftest.py": "import pytest\n\n@pytest.fixture\ndef one(tmp):\n    '''Doc.'''\n    return tmp / 'x'\n",
        "a/conftest.py": "from pytest import fixture\n\n@fixture(scope='session')\ndef same(tmp):\n    return tmp / 'x'\n",
        "b/conftest.py": "import pytest\n\n@pytest.fixture(scope='session')\ndef data(tmp):\n" + loop.format(dir="b", n=64),
        "c/conftest.py": "import pytest\n\n@pytest.fixture(scope='session')\ndef dataset(tmp):\n" + loop.format(dir="c", n=48)
                         + "\n@pytest.fixture\ndef short(tmp):\n    return tmp / 'y'\n",
    })
    assert duplicated_fixtures(root) == ["a/conftest.py::same ~ conftest.py::one", "b/conftest.py::data ~ c/conftest.py::dataset"]


def test_no_two_test_modules_outside_packages_share_a_file_name() -> None:
    """pytest imports a test module outside a package by its file name alone, so two
    ``test_spec.py`` in two folders fail the whole run's collection ("import file mismatch") as
    soon as one process collects both: something a run of one folder never shows."""
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {name: where for name, where in seen.items() if len(where) > 1}
