"""Fixtures every test may use. Nothing here touches a server: see tests/integration/conftest.py.
The tiny Llama and chat dataset the stacks train on are a plugin (tests/fixtures/training_inputs.py);
plain helpers (not fixtures) are in tests/helpers.py and tests/fixtures/."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.fixtures.training_inputs", "tests.fixtures.slurm"]
"""Fixture modules every test may use besides this file's (tests/fixtures/README.md: the map)."""
# The helpers in tests/fixtures assert as test modules do: their failures show the values.
pytest.register_assert_rewrite("tests.fixtures")

REPO_ROOT = Path(__file__).resolve().parent.parent
# The suite makes hundreds of in-process apps that never tokenize: none starts a tokenizer process
# ahead of use (a fork server importing transformers each). Stacks of real `ftq api` processes
# (tests/integration/e2e) leave FTQ_* behind and start one, as a deployment does.
os.environ.setdefault("FTQ_TOKENIZER_PRESTART", "false")
# One intra-op thread in every test process and what it starts (before anything imports torch): the
# suite runs three pytest workers and their trainers, servers and ranks on two cores, where a second
# OpenMP thread per process only spin-waits for a core (CPU burnt, nothing sooner); the stacks and
# the rank tests set the same for their processes (tests/fixtures/stack.py STACK_ENV).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# pytest caches each test module's assertion-rewritten code object next to it (``__pycache__/*-pytest-*.pyc``)
# unless ``sys.dont_write_bytecode``, which this machine's image sets (``PYTHONDONTWRITEBYTECODE=1``):
# then every pytest process (each xdist worker collects the whole suite) rewrote and compiled all the
# test modules again. Written here, before the test modules are collected; what this process starts
# keeps the environment's setting (ftq's own packages are compiled by ``make test``).
sys.dont_write_bytecode = False
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def _tiny_model_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-template") / "tiny", "llama")


@pytest.fixture
def model_root(tmp_path: Path, _tiny_model_template: Path) -> Path:
    """A model root holding ``tiny``: a tiny random-weight Llama with its tokenizer (built once per
    session, copied per test), which passes the submission checks (its files match its config,
    its tokenizer preflights the data)."""
    root = tmp_path / "models"
    shutil.copytree(_tiny_model_template, root / "tiny")
    return root


FOLDER_UNITS = ("tests/integration/browser/", "tests/netns/")
"""Folders whose modules share one stack (the browser's package-scoped one, their ``__init__.py``
making them a package; the netns deployment, session-scoped): pytest-xdist hands each to one worker
whole, so the stack starts once per run."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (``make test``) with the ``FOLDER_UNITS`` each one unit of work: a module
    per worker at a time, so a module's fixtures start once (loadscope would split its classes over
    workers, each starting them again), and a folder's package fixtures too."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FolderUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            folder = next((f for f in FOLDER_UNITS if nodeid.startswith(f)), None)
            return folder or super()._split_scope(nodeid)

    return FolderUnits(config, log)


HEAVY_FIRST = (
    "tests/netns/test_netns_machines.py",
    "tests/integration/e2e/test_jobs_e2e.py",
    "tests/unit/trainer/parallel/test_distributed_runs.py",
    "tests/integration/e2e/test_multi_machine_e2e.py",
    "tests/integration/e2e/test_generate_e2e.py",
    "tests/integration/browser/",
    "tests/integration/e2e/",
    "tests/faults/",
    "tests/netns/",
    "tests/unit/trainer/parallel/",
)
"""Where the run's long modules are (tens of seconds to minutes each, few tests): ``make test`` hands
them out first (``--no-loadscope-reorder`` keeps the collection order, which
``pytest_collection_modifyitems`` sets), so the last minutes are not one of them on one worker
while the others idle; xdist's own order (most tests first) puts such modules last."""


def _heaviness(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(HEAVY_FIRST) if nodeid.startswith(prefix)), len(HEAVY_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getvalue("dist") == "loadfile":
        items.sort(key=lambda item: _heaviness(item.nodeid))  # stable: a module's own order stays


def pytest_configure(config: pytest.Config) -> None:
    try:  # the GPU image runs tests/gpu without the service's packages
        import sqlalchemy  # noqa: F401
    except ImportError:
        return
    # kombu's SQLAlchemy transport (the embedded broker) declares a relationship with
    # lazy="noload", deprecated in SQLAlchemy 2.1; it is kombu's to fix, not an ftq bug.
    config.addinivalue_line(
        "filterwarnings", "ignore:The ``noload`` loader strategy is deprecated:sqlalchemy.exc.SADeprecationWarning"
    )


CPU_REPORT = os.environ.get("FTQ_TEST_CPU_REPORT")
"""A file each test's CPU seconds are appended to (``nodeid<TAB>seconds``), when set: the test
process's own user+system time plus its finished children's (subprocesses it waited for:
trainers, torchrun, stacks), i.e. what the test costs the machine, which on a loaded 2-core box
its wall time (``--durations``, junit) does not tell. A module's fixtures count in its first test."""


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not CPU_REPORT:
        yield
        return
    start = _cpu_seconds()
    yield
    with open(CPU_REPORT, "a", encoding="utf-8") as report:
        report.write(f"{item.nodeid}\t{_cpu_seconds() - start:.2f}\n")
