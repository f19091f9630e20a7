"""The API's route hints, said as ``ftq`` commands.

The API writes its error messages for REST clients: ``no job 'job-x'; list jobs with GET /v1/jobs``.
The CLI prints the same message with the command that does it: ``list jobs with `ftq jobs```.
The API's text stays as it is (a REST user needs the route); the CLI translates, so the API
needs no machine-readable hint field and the two stay decoupled: a route with no command here
is printed as the API wrote it.

A route in a message becomes:

1. the API's own command beside it, when the message gives one (``GET /v1/users (or `ftq users
   list`)``, ``(GET /v1/jobs/x/checkpoints; `ftq download x --step N`)``): the route is dropped;
2. else the command of ``ROUTES`` for it, its ``{id}`` filled from the path; an entry may also
   take the words after the route that only a REST client needs (``tail``);
3. else nothing: the route stays (``LEFT_AS_IS`` names those the API's messages use, and why).

``ROUTES`` is filtered by the parser's own commands (``table``), so a translation can
only name a command ``ftq`` has; ``tests/unit/cli/test_cli_hints.py`` checks every route of
every error message in ``api/`` and ``core/`` against it.
"""

from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass

from trainer.catalog import EXPORT_FORMATS

ROUTE = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE) (/v1/[^\s;,()`'\"]*[^\s;,()`'\".])")
"""A method and a path in a message (a trailing full stop is the sentence's, not the path's)."""
BESIDE = re.compile(r" \(or (`ftq [^`]+`)\)| or (`ftq [^`]+`)|; (`ftq [^`]+`)")
"""The API's own command right after a route (rule 1)."""


@dataclass(frozen=True)
class RouteHint:
    route: str
    """``METHOD /v1/path``, ``{id}`` for one path segment."""
    command: str
    """What follows ``ftq``: the command's words, then arguments (``{id}`` is the route's)."""
    tail: str = ""
    """A regex for the words after the route that the command replaces too."""
    after: str = ""
    """Text printed after the command (what to give it)."""

    def pattern(self) -> re.Pattern[str]:
        method, path = self.route.split(" ", 1)
        path = re.escape(path).replace(re.escape("{id}"), r"(?P<id>[^/\s;,()`'\"]+)")
        return re.compile(rf"\b{method} {path}(?![^\s;,()`'\".]|\.\S)(?P<tail>{self.tail})")


_FILE_TAIL = r"(?: \(purpose=[^)\s]+\))? and use (?:its|the returned) id(?: \(file-<24 hex>\))?"

ROUTES: tuple[RouteHint, ...] = (
    RouteHint("GET /v1/jobs", "jobs"),
    RouteHint("GET /v1/evals", "eval list"),
    RouteHint("POST /v1/jobs", "submit JOB.yaml"),
    RouteHint("GET /v1/jobs/{id}", "show {id}"),
    RouteHint("GET /v1/jobs/{id}/checkpoints", "show {id}"),
    RouteHint("POST /v1/jobs/{id}/clone", "rerun {id}"),
    RouteHint("POST /v1/jobs/{id}/resume", "resume {id}"),
    RouteHint("POST /v1/jobs/{id}/cancel", "cancel {id}"),
    RouteHint("GET /v1/jobs/{id}/events", "logs {id}"),
    RouteHint("GET /v1/jobs/{id}/metrics", "metrics {id}"),
    RouteHint("GET /v1/jobs/{id}/metrics.csv", "metrics {id}"),
    RouteHint("GET /v1/jobs/{id}/adapter", "download {id}"),
    RouteHint("GET /v1/jobs/{id}/exports", "exports {id}"),
    RouteHint("GET /v1/jobs/{id}/completions", "completions {id}"),
    RouteHint("GET /v1/jobs/{id}/completions/preview", "completions {id} --head 5"),
    RouteHint("POST /v1/jobs/{id}/exports", "export {id} --format " + "|".join(EXPORT_FORMATS)),
    RouteHint("GET /v1/queue", "jobs --status queued"),
    RouteHint("GET /v1/sessions", "sessions"),
    RouteHint("GET /v1/sessions/{id}", "sessions"),
    RouteHint("GET /v1/hardware", "machines"),
    RouteHint("GET /v1/projects", "projects list"),
    RouteHint("GET /v1/workers/keys", "workers key list"),
    RouteHint("POST /v1/workers/keys", "workers key create NAME"),
    # The CLI uploads a dataset as part of a submission: a local path where the file id goes.
    RouteHint("POST /v1/files", "submit JOB.yaml", tail=_FILE_TAIL,
              after=": give the local JSONL path in place of the file id, the CLI uploads it"),
)

LEFT_AS_IS: dict[str, str] = {
    "GET /v1/files": "no command lists uploaded files; the CLI uploads a job's files itself",
    "GET /v1/users/me": "no command shows the caller (`ftq login` prints it when it saves a key)",
}
"""Routes the API's messages name that stay as written, and why."""


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The commands under ``parser`` by name (empty for a leaf)."""
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def names_command(parser: argparse.ArgumentParser, command: str) -> bool:
    """Whether ``ftq COMMAND`` (``"workers key list"``, ``"download {id} --step N"``) is a runnable
    command of ``parser`` given no more bare words than it takes (``jobs adapter`` is not one)."""
    words = command.split()
    node, at = parser, 0
    while at < len(words) and subcommands(node):
        node = subcommands(node).get(words[at])
        if node is None:
            return False
        at += 1
    if at == 0 or subcommands(node):
        return False
    bare = list(itertools.takewhile(lambda word: not word.startswith("-"), words[at:]))
    return len(bare) <= len([a for a in node._actions if not a.option_strings])


def table(parser: argparse.ArgumentParser) -> tuple[RouteHint, ...]:
    """The entries of ``ROUTES`` whose command ``parser`` has."""
    return tuple(hint for hint in ROUTES if names_command(parser, hint.command))


def translate(message: str, parser: argparse.ArgumentParser | None = None) -> str:
    """``message`` with each route hint said as an ``ftq`` command (module docstring's rules).

    Args:
        message: an API error message.
        parser: the CLI's parser; default ``ftq``'s own (``cli.main.build_parser``).
    """
    if parser is None:
        from cli.main import build_parser  # cli.main imports every command module, this one too

        parser = build_parser()
    hints = table(parser)
    out, at = [], 0
    for found in ROUTE.finditer(message):
        if found.start() < at:
            continue
        beside = BESIDE.match(message, found.end())
        if beside:
            out += [message[at:found.start()], next(g for g in beside.groups() if g)]
            at = beside.end()
            continue
        for hint in hints:
            matched = hint.pattern().match(message, found.start())
            if matched:
                command = hint.command.format(id=matched.groupdict().get("id") or "")
                out += [message[at:found.start()], f"`ftq {command}`{hint.after}"]
                at = matched.end()
                break
    return "".join(out) + message[at:]
