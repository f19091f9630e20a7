"""The API stays light and inside its boundary: no torch, no worker, nothing at import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from api.jobs.sse import format_event

REPO = Path(__file__).resolve().parents[3]


def test_importing_and_building_the_app_pulls_no_torch_or_worker() -> None:
    code = (
        "import sys; from api.app import create_app; create_app(); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'worker', 'transformers', 'peft')); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_app_uses_only_the_trainers_standard_library_modules() -> None:
    """``trainer.plan.memory`` is the estimate ``GET /v1/models`` says whether a model fits with
    (``api.models.fit``); ``test_models_fit`` checks that computing it imports no torch.
    ``trainer.objectives`` is the objectives' registry (its torch-free part): the spec's objectives,
    ``MetricOut``'s fields and the charts. ``trainer.generate.job_config``, ``outputs`` and ``prompts``
    are a generation job's job.json, its output files and its prompts file (standard library only).
    ``trainer.graders`` are the graders ``graders.run`` runs (standard library; only
    ``judge.engine_judge`` imports the sampler, when it is called). ``trainer.evals.config`` and
    ``results`` are an eval run's job.json and its pass rules and totals (standard library)."""
    code = (
        "import sys; from api.app import create_app; create_app(); "
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'trainer')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert set(out.stdout.strip().split(",")) <= {"trainer", "trainer.catalog", "trainer.config", "trainer.events",
                                                   "trainer.training", "trainer.training.layout", "trainer.plan",
                                                   "trainer.plan.memory", "trainer.objectives",
                                                   "trainer.objectives.registry", "trainer.objectives.declarations",
                                                   "trainer.objectives.grpo_config",
                                                   "trainer.generate", "trainer.generate.job_config",
                                                   "trainer.generate.outputs", "trainer.generate.prompts",
                                                       "trainer.generate.session_config",
                                                   "trainer.graders", "trainer.graders.errors", "trainer.graders.formula",
                                                   "trainer.graders.judge", "trainer.graders.run",
                                                   "trainer.graders.sandbox", "trainer.graders.spec",
                                                   "trainer.graders.template", "trainer.graders.text",
                                                   "trainer.evals", "trainer.evals.config", "trainer.evals.results"}


def test_sse_event_format() -> None:
    assert format_event(7, "step", {"step": 3, "loss": 0.5}) == b'id: 7\nevent: step\ndata: {"step":3,"loss":0.5}\n\n'


# The store is read and written by core's services; api/ parses, calls them, and shapes the reply.
# A route may open a session and end its transaction (commit, rollback, close), never query with it.
_SQL_IMPORTS = {"sqlalchemy.orm": {"Session", "sessionmaker"}, "sqlalchemy": {"Engine"}}
"""What api/ may import from SQLAlchemy besides ``sqlalchemy.exc`` (error mapping): type names."""
_SESSION_NAMES = {"session", "conn", "connection"}
_QUERYING = {"query", "execute", "scalar", "scalars", "get", "add", "add_all", "delete", "merge", "flush", "refresh"}


def _store_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "sqlalchemy" for a in node.names):
            found.append(f"{node.lineno}: import sqlalchemy")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sqlalchemy":
            if node.module != "sqlalchemy.exc":
                extra = {a.name for a in node.names} - _SQL_IMPORTS.get(node.module or "", set())
                found += [f"{node.lineno}: from {node.module} import {name}" for name in sorted(extra)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _QUERYING
              and isinstance(node.func.value, ast.Name) and node.func.value.id in _SESSION_NAMES):
            found.append(f"{node.lineno}: {node.func.value.id}.{node.func.attr}(...)")
    return found


def test_api_queries_the_store_only_through_core_services() -> None:
    uses = {str(path.relative_to(REPO)): found for path in sorted((REPO / "api").rglob("*.py"))
            if (found := _store_uses(path))}
    assert uses == {}, f"move these queries into a core service and call it: {uses}"


def test_the_store_rule_sees_a_query(tmp_path: Path) -> None:
    sample = tmp_path / "routes.py"
    sample.write_text("from sqlalchemy import select\nfrom sqlalchemy.orm import Session\n"
                      "def f(session):\n    session.commit()\n    return session.get(X, 1)\n")
    assert _store_uses(sample) == ["1: from sqlalchemy import select", "5: session.get(...)"]
