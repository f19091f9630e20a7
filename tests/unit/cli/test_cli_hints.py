"""The CLI says the API's route hints as ``ftq`` commands (``cli/hints.py``), and a refused or
missing key says where the key came from and how to get one (``cli/client.key_hint``)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cli import client as cli_client
from cli import hints, jobs
from cli.errors import CliError
from cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[3]
COMMAND = re.compile(r"`ftq ([^`]+)`")


@pytest.fixture(scope="module")
def messages() -> list[tuple[str, str]]:
    """``(where, text)`` of every string raised in ``api/`` and ``core/`` that names a route; an
    f-string's fields are shown as ``{expression}``."""
    found = []
    for path in sorted([*ROOT.glob("api/**/*.py"), *ROOT.glob("core/**/*.py")]):
        for raise_ in (n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Raise)):
            for line, text in _strings(raise_.exc) if raise_.exc else ():
                if hints.ROUTE.search(text):
                    found.append((f"{path.relative_to(ROOT)}:{line}", text))
    return found


def _strings(node: ast.AST) -> Iterator[tuple[int, str]]:
    """The whole strings under ``node`` (an f-string once, not its pieces)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.lineno, node.value
    elif isinstance(node, ast.JoinedStr):
        yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                                   for v in node.values)  # type: ignore[attr-defined]
    else:
        for child in ast.iter_child_nodes(node):
            yield from _strings(child)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def small_cli(*names: str) -> argparse.ArgumentParser:
    """A parser with leaf commands ``names``, each taking one job id."""
    parser = argparse.ArgumentParser(prog="ftq")
    commands = parser.add_subparsers()
    for name in names:
        commands.add_parser(name).add_argument("job_id")
    return parser


class TestTranslate:
    @pytest.mark.parametrize(("message", "said"), [
        ("no job 'job-1'; list jobs with GET /v1/jobs", "no job 'job-1'; list jobs with `ftq jobs`"),
        ("job job-1 is running; only a failed or cancelled job can be resumed (clone it instead: "
         "POST /v1/jobs/job-1/clone)",
         "job job-1 is running; only a failed or cancelled job can be resumed (clone it instead: `ftq rerun job-1`)"),
        ("job job-1 has no checkpoint at step 3; list them with GET /v1/jobs/job-1/checkpoints",
         "job job-1 has no checkpoint at step 3; list them with `ftq show job-1`"),
        ("no user 'bo'; list users with GET /v1/users (or `ftq users list`)",
         "no user 'bo'; list users with `ftq users list`"),
        ("its checkpoints (GET /v1/jobs/job-1/checkpoints; `ftq download job-1 --step N`) can be downloaded now",
         "its checkpoints (`ftq download job-1 --step N`) can be downloaded now"),
        ("training_file: no file 'file-1'; upload it with POST /v1/files (purpose=train) and use its id",
         "training_file: no file 'file-1'; upload it with `ftq submit JOB.yaml`: give the local JSONL path "
         "in place of the file id, the CLI uploads it"),
        ("see GET /v1/jobs/job-1/metrics.csv.", "see `ftq metrics job-1`."),
        ("no file 'file-1'; list uploaded files with GET /v1/files",
         "no file 'file-1'; list uploaded files with GET /v1/files"),
    ])
    def test_a_route_becomes_its_command_or_stays(self, parser, message, said):
        assert hints.translate(message, parser) == said

    def test_a_command_the_cli_lacks_is_never_named(self):
        message = "clone it instead: POST /v1/jobs/job-1/clone; see GET /v1/jobs/job-1"
        said = "clone it instead: POST /v1/jobs/job-1/clone; see `ftq show job-1`"
        assert hints.translate(message, small_cli("show")) == said
        shown = ["GET /v1/jobs/{id}", "GET /v1/jobs/{id}/checkpoints"]
        assert [hint.route for hint in hints.table(small_cli("show"))] == shown

    @pytest.mark.parametrize(("command", "exists"), [
        ("jobs", True), ("jobs adapter", False), ("download {id} --step N", True), ("download a b", False),
        ("workers key list", True), ("workers key", False), ("workers", False), ("nope", False),
    ])
    def test_a_command_is_named_only_if_ftq_runs_it(self, parser, command, exists):
        assert hints.names_command(parser, command) is exists

    def test_every_entry_names_a_command_ftq_has(self, parser):
        assert hints.table(parser) == hints.ROUTES
        assert not set(hints.LEFT_AS_IS) & {hint.route for hint in hints.ROUTES}


class TestTheApisMessages:
    def test_they_are_found(self, messages):
        assert len(messages) >= 10  # the scan itself works: a dozen messages name routes today

    def test_every_route_is_translated_or_deliberately_left(self, parser, messages):
        for where, message in messages:
            for method, path in hints.ROUTE.findall(hints.translate(message, parser)):
                assert f"{method} {path}" in hints.LEFT_AS_IS, f"{where}: {method} {path} has no ftq command: {message}"

    def test_every_left_route_is_still_named_somewhere(self, messages):
        routes = {f"{m} {p}" for _, text in messages for m, p in hints.ROUTE.findall(text)}
        assert set(hints.LEFT_AS_IS) <= routes

    def test_every_command_they_name_exists(self, parser, messages):
        for where, message in messages:
            for command in COMMAND.findall(hints.translate(message, parser)):
                assert hints.names_command(parser, command), f"{where}: `ftq {command}` is no ftq command"


class TestThroughTheCli:
    def test_a_missing_job_names_ftq_jobs(self, api, monkeypatch, capsys):
        monkeypatch.setattr(jobs, "connect", lambda: contextlib.nullcontext(api))
        assert main(["show", "job-nope"]) == 2
        err = capsys.readouterr().err
        assert "list jobs with `ftq jobs`" in err and "with GET /v1/jobs" not in err


def refused(headers: dict[str, str]) -> httpx.Response:
    request = httpx.Request("GET", "http://api/v1/jobs", headers=headers)
    return httpx.Response(401, json={"error": {"message": "API key is not valid", "param": None}}, request=request)


class TestKeyHints:
    @pytest.fixture
    def no_config(self, tmp_path, monkeypatch) -> Path:
        monkeypatch.delenv("FTQ_API_KEY", raising=False)
        monkeypatch.setenv("FTQ_CONFIG", str(tmp_path / "config.toml"))
        return tmp_path / "config.toml"

    def test_no_key_says_the_file_is_absent_and_how_to_get_one(self, no_config):
        with pytest.raises(CliError) as exc:
            cli_client.check(refused({}))
        text = str(exc.value)
        assert f"FTQ_API_KEY is not set and the config file {no_config} does not exist" in text
        assert "`ftq up`" in text and "ftq login --key KEY" in text and "FTQ_API_KEY=KEY" in text
        assert "key from" not in text

    def test_a_refused_key_names_where_it_came_from(self, no_config, monkeypatch):
        with pytest.raises(CliError, match=r"not valid \(the key from the command line; "):
            cli_client.check(refused({"Authorization": "Bearer ftq_x"}))
        no_config.write_text('api_key = "ftq_file"\n')
        with pytest.raises(CliError, match=rf"not valid \(the key from {re.escape(str(no_config))}; "):
            cli_client.check(refused({"Authorization": "Bearer ftq_file"}))
        monkeypatch.setenv("FTQ_API_KEY", "ftq_env")
        with pytest.raises(CliError, match=r"not valid \(the key from FTQ_API_KEY; "):
            cli_client.check(refused({"Authorization": "Bearer ftq_env"}))
