"""Lists defined once (``trainer.catalog``): each consumer reads the home list, and no module spells one.

    methods, schedulers   -> core.jobs.spec's Literals -> /openapi.json -> the new-job form
    export formats,       -> trainer.export.formats, trainer.export.gguf, core.exports.service, the export API's
    quantizations            schema, ``ftq export`` and ``python -m trainer export``; the job page's
                             export buttons are presets that must name listed values
    trackers              -> core.settings, core.jobs.trackers, the job spec's ``tracking`` fields,
                             worker.tracking's builders

The walk fails on a literal tuple, list or set (a ``Literal[...]``, argparse ``choices``, a
dashboard array) of two or more strings that all belong to one home list, anywhere but the home.
A table keyed by the values (a dict: one implementation per value) is checked against the home
where it is one of the tables below.
"""

from __future__ import annotations

import argparse
import ast
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from trainer import catalog

REPO = Path(__file__).resolve().parents[2]
STATIC = REPO / "api" / "web" / "static"
HOME = REPO / "trainer" / "catalog.py"
PACKAGES = ("trainer", "worker", "api", "core", "cli")

LISTS = {
    "METHODS": catalog.METHODS,
    "SCHEDULERS": catalog.SCHEDULERS,
    "EXPORT_FORMATS": catalog.EXPORT_FORMATS,
    "QUANTIZATIONS": catalog.QUANTIZATIONS,
    "GGUF_MODEL_TYPES": catalog.GGUF_MODEL_TYPES,
    "TRACKERS": tuple(catalog.TRACKERS),
    "SERVER_TRACKERS": catalog.SERVER_TRACKERS,
}
CHOSEN_SUBSETS = {
    ("api/models/fit.py", ("lora", "full")): "the methods whose memory fit the model list estimates",
}
"""Literals that pick some values of a list on purpose, and why (not a copy of the list)."""


def _strings(node: ast.AST) -> tuple[str, ...] | None:
    """The strings of a tuple/list/set literal made only of string constants, else None."""
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or len(node.elts) < 2:
        return None
    if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return None
    return tuple(e.value for e in node.elts)  # type: ignore[attr-defined]


def _copied_list(values: tuple[str, ...]) -> str | None:
    """The home list ``values`` all belong to, if any."""
    return next((name for name, home in LISTS.items() if set(values) <= set(home)), None)


def _python_copies(source: str, rel: str) -> list[str]:
    """Each list of the catalog that the module ``rel`` (its text: ``source``) spells itself."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):  # a Literal's arguments and argparse's choices are such literals too
        values = _strings(node)
        name = _copied_list(values) if values else None
        if name and (rel, values) not in CHOSEN_SUBSETS:
            found.append(f"{rel}:{node.lineno} {values} (trainer.catalog.{name})")
    return found


def _js_copies(source: str, rel: str) -> list[str]:
    """Each list of the catalog that the script ``rel`` spells as an array of strings."""
    found = []
    for match in re.finditer(r"\[([^\[\]]*)\]", source):
        values = tuple(re.findall(r'"([^"\\]*)"', match.group(1)))
        if len(values) >= 2 and re.fullmatch(r'\s*"[^"]*"(\s*,\s*"[^"]*")*\s*,?\s*', match.group(1)):
            if name := _copied_list(values):
                found.append(f"{rel} {values} (trainer.catalog.{name})")
    return found


def test_the_catalog_imports_only_the_standard_library() -> None:
    tree = ast.parse(HOME.read_text())
    imported = [n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
    assert imported == ["__future__"]


class TestNoCopies:
    def test_no_module_spells_a_list_of_the_catalog(self) -> None:
        offenders = [
            copy
            for top in PACKAGES
            for path in sorted((REPO / top).rglob("*.py"))
            if path != HOME
            for copy in _python_copies(path.read_text(), path.relative_to(REPO).as_posix())
        ]
        assert not offenders, f"read these from trainer.catalog instead: {offenders}"

    def test_the_dashboard_spells_no_list_of_the_catalog(self) -> None:
        offenders = [copy for path in sorted(STATIC.glob("*.js")) for copy in _js_copies(path.read_text(), path.name)]
        assert not offenders, f"read these from /openapi.json instead: {offenders}"

    def test_the_walk_finds_a_copy(self) -> None:
        """The checks above can fail: a retyped list, a Literal, choices and a dashboard array are found."""
        source = ('from typing import Literal\nA = ("cosine", "linear")\nB = Literal["merged", "gguf"]\n'
                  'p.add_argument("--q", choices=["f16", "q8_0"])\nC = ("lora", "other")\n')
        assert [copy.split(" (")[-1] for copy in _python_copies(source, "core/x.py")] == [
            "trainer.catalog.SCHEDULERS)", "trainer.catalog.EXPORT_FORMATS)", "trainer.catalog.QUANTIZATIONS)"]
        assert _python_copies('FIT = ("lora", "full")\n', "api/models/fit.py") == []
        js = 'const s = ["cosine", "linear", "constant"].map((v) => v);\nconst n = [1, 2];\nconst t = ["sft"];\n'
        assert _js_copies(js, "view.js") == ["view.js ('cosine', 'linear', 'constant') (trainer.catalog.SCHEDULERS)"]


def _enum(prop: dict[str, Any]) -> tuple[str, ...]:
    if "enum" in prop:
        return tuple(prop["enum"])
    (listed,) = [p for p in prop["anyOf"] if "enum" in p]
    return tuple(listed["enum"])


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    from api.app import create_app

    return create_app().openapi()["components"]["schemas"]


class TestConsumers:
    def test_the_job_spec_and_its_schema_list_the_methods_and_schedulers(self, schemas: dict[str, Any]) -> None:
        from core.jobs.spec import Hyperparameters, JobSpec, Method, Scheduler

        assert typing.get_args(Method) == catalog.METHODS
        assert typing.get_args(Scheduler) == catalog.SCHEDULERS
        assert _enum(schemas["JobSpec"]["properties"]["method"]) == catalog.METHODS
        assert _enum(schemas["Hyperparameters"]["properties"]["lr_scheduler"]) == catalog.SCHEDULERS
        assert JobSpec.model_fields["method"].default in catalog.METHODS
        assert Hyperparameters.model_fields["lr_scheduler"].default in catalog.SCHEDULERS

    def test_the_form_takes_the_schedules_from_the_schema(self) -> None:
        js = (STATIC / "view-new.js").read_text()
        assert '"/openapi.json"' in js and "p.enum" in js
        assert not [name for name in catalog.SCHEDULERS if f'"{name}"' in js], "view-new.js spells a schedule"

    def test_the_export_api_lists_the_formats_and_quantizations(self, schemas: dict[str, Any]) -> None:
        props = schemas["ExportRequest"]["properties"]
        assert _enum(props["format"]) == catalog.EXPORT_FORMATS
        assert _enum(props["quantization"]) == catalog.QUANTIZATIONS
        assert ", ".join(catalog.GGUF_MODEL_TYPES) in props["format"]["description"]
        assert f"default {catalog.DEFAULT_QUANTIZATION}" in props["quantization"]["description"]

    def test_every_export_format_has_its_stages_and_the_gguf_writer_its_model_types(self) -> None:
        from core.exports.service import STAGE_WEIGHTS
        from trainer.export.gguf import ARCHITECTURES

        assert tuple(STAGE_WEIGHTS) == catalog.EXPORT_FORMATS
        model_types = {name.removesuffix("ForCausalLM").lower() for name in ARCHITECTURES}
        assert model_types == set(catalog.GGUF_MODEL_TYPES)
        assert catalog.DEFAULT_QUANTIZATION in catalog.QUANTIZATIONS

    @pytest.mark.parametrize("cli", ["ftq", "trainer"])
    def test_both_export_commands_offer_the_formats(self, cli: str) -> None:
        if cli == "ftq":
            from cli.main import build_parser

            parser = build_parser()
        else:
            from trainer.export import cli as export_cli

            parser = argparse.ArgumentParser()
            export_cli.add_parser(parser.add_subparsers())
        (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        export = {a.dest: a for a in commands.choices["export"]._actions}
        assert tuple(export["format"].choices) == catalog.EXPORT_FORMATS
        if cli == "ftq":
            assert tuple(export["quantization"].choices) == catalog.QUANTIZATIONS
        else:
            assert export["quantization"].default == catalog.DEFAULT_QUANTIZATION

    def test_every_export_button_names_listed_values_and_every_format_has_one(self) -> None:
        js = (STATIC / "view-job-exports.js").read_text()
        presets = re.findall(r'body: \{ format: "([^"]+)"(?:, quantization: "([^"]+)")? \}', js)
        assert presets, "view-job-exports.js: no export buttons found"
        for fmt, quantization in presets:
            assert fmt in catalog.EXPORT_FORMATS, fmt
            assert not quantization or quantization in catalog.QUANTIZATIONS, quantization
        assert {fmt for fmt, _ in presets} == set(catalog.EXPORT_FORMATS)

    def test_the_trackers_are_the_catalogs(self) -> None:
        from core.jobs.spec import TrackingSpec
        from core.jobs.trackers import KINDS
        from core.settings import TrackingServer
        from worker.tracking import resolve

        assert tuple(resolve._BUILDERS) == tuple(catalog.TRACKERS)
        assert tuple(resolve.installed()) == tuple(catalog.TRACKERS)
        assert set(catalog.TRACKERS) <= set(TrackingSpec.model_fields)
        assert typing.get_args(TrackingServer.model_fields["kind"].annotation) == catalog.SERVER_TRACKERS
        assert tuple(KINDS) == catalog.SERVER_TRACKERS
