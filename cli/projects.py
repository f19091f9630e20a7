"""``ftq projects ...``: the projects you are in, through the API.

    ftq projects list                              yours (an admin: all), your role, the default
    ftq projects create NAME [--max-gpus N] [--max-priority P] [--tracking-servers S]  (global admin)
    ftq projects set NAME [--max-gpus N|none] [--max-priority P|none] [--tracking-servers S]  (global admin)
                                                   S: NAME[,NAME...] of the box's tracking servers
                                                   its jobs may use, all (the box's: the default)
                                                   or none (a server named all or none: "none,")
    ftq projects members NAME                      who is in it, with their roles
    ftq projects add-member NAME USER [--role admin]               (project or global admin)
    ftq projects remove-member NAME USER                           (project or global admin)
    ftq projects default NAME [--local]            where your work goes when a command names none:
                                                   on the box for your user, or (--local) only in
                                                   this client's config file (``project``)

Commands that create or list work take ``--project NAME``; without it they use the config file's
``project`` (``FTQ_PROJECT`` wins), else your key's or your user's default on the box.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli import config
from cli.client import call, connect
from cli.errors import CliError

HEADER = ("NAME", "ROLE", "DEFAULT", "MAX GPUS", "MAX PRIORITY", "TRACKING SERVERS")


def add_parsers(commands: Any) -> None:
    parser = commands.add_parser("projects", help="projects: the teams work belongs to (through the API)")
    sub = parser.add_subparsers(dest="projects_command", required=True, metavar="PROJECTS_COMMAND")
    sub.add_parser("list", help="the projects you are in").set_defaults(run=run_list)
    for name, helptext, run in (("create", "make a project (global admin)", run_create),
                                ("set", "change a project's quota or ceiling (global admin)", run_set)):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("name")
        p.add_argument("--max-gpus", help="GPUs its running jobs may hold at once (none: no quota)")
        p.add_argument("--max-priority", help="the highest priority its jobs may ask for: low, normal, high or none")
        p.add_argument("--tracking-servers", metavar="NAME[,NAME...]|all|none",
                       help="the box's tracking servers its jobs may send to: names, comma-separated, "
                            "all (the box's, the default) or none")
        p.set_defaults(run=run)
    p = sub.add_parser("members", help="a project's members and roles")
    p.add_argument("name")
    p.set_defaults(run=run_members)
    p = sub.add_parser("add-member", help="add a user to a project, or change their role")
    p.add_argument("name")
    p.add_argument("user")
    p.add_argument("--role", choices=["member", "admin"], default="member")
    p.set_defaults(run=run_add_member)
    p = sub.add_parser("remove-member", help="remove a user from a project (their work stays in it)")
    p.add_argument("name")
    p.add_argument("user")
    p.set_defaults(run=run_remove_member)
    p = sub.add_parser("default", help="where your work goes when a command names no project")
    p.add_argument("name")
    p.add_argument("--local", action="store_true", help="only in this client's config file")
    p.set_defaults(run=run_default)


def add_project_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--project NAME`` on a command that creates or lists work."""
    parser.add_argument("--project", help=f"{what} (default: FTQ_PROJECT, the config file's project, "
                        "else your default project on the box)")


def chosen(args: argparse.Namespace) -> str | None:
    """The project a command works in: ``--project``, else ``FTQ_PROJECT`` or the config file's."""
    return getattr(args, "project", None) or config.default_project()


def run_list(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        data = call(client, "GET", "/v1/projects").json()["data"]
    print(format_projects(data), file=out or sys.stdout)
    return 0


def _quota_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if args.max_gpus is not None:
        if args.max_gpus != "none" and not args.max_gpus.isdigit():
            raise CliError(f"--max-gpus: {args.max_gpus!r} is not a number of GPUs (or none)")
        body["max_gpus"] = None if args.max_gpus == "none" else int(args.max_gpus)
    if args.max_priority is not None:
        body["max_priority"] = None if args.max_priority == "none" else args.max_priority
    if args.tracking_servers is not None:
        body["tracking_servers"] = _server_names(args.tracking_servers)
    return body


def _server_names(value: str) -> list[str] | None:
    """``--tracking-servers``: ``all`` is None (the box's), ``none`` [], else the names; a list
    with a comma (``none,``) is always names."""
    if value.strip() in ("all", "none"):
        return None if value.strip() == "all" else []
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise CliError(f"--tracking-servers: {value!r} names no server; give NAME[,NAME...], all or none")
    return names


def run_create(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        project = call(client, "POST", "/v1/projects", json={"name": args.name, **_quota_body(args)}).json()
    print(f"project {project['name']} ({project['id']})", file=out or sys.stdout)
    return 0


def run_set(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        project = call(client, "PATCH", f"/v1/projects/{args.name}", json=_quota_body(args)).json()
    print(format_projects([project]), file=out or sys.stdout)
    return 0


def run_members(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        data = call(client, "GET", f"/v1/projects/{args.name}/members").json()["data"]
    print("\n".join(f"{m['user']}  {m['role']}" for m in data) or "no members", file=out or sys.stdout)
    return 0


def run_add_member(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        member = call(client, "PUT", f"/v1/projects/{args.name}/members/{args.user}", json={"role": args.role}).json()
    print(f"{member['user']} is a project {member['role']} of {args.name}", file=out or sys.stdout)
    return 0


def run_remove_member(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        call(client, "DELETE", f"/v1/projects/{args.name}/members/{args.user}")
    print(f"{args.user} is no longer a member of {args.name}", file=out or sys.stdout)
    return 0


def run_default(args: argparse.Namespace, out: Any = None) -> int:
    with connect() as client:
        project = call(client, "GET", f"/v1/projects/{args.name}").json()  # yours, or a 404
        if not args.local:
            call(client, "PUT", f"/v1/projects/{args.name}/default")
    if args.local:
        path = config.save_config({"project": project["name"]})
        print(f"this client's commands now work in {project['name']} (project in {path})", file=out or sys.stdout)
    else:
        print(f"your default project is now {project['name']}", file=out or sys.stdout)
    return 0


def _servers_cell(project: dict[str, Any]) -> str:
    servers = project.get("tracking_servers")
    return "all" if servers is None else (",".join(servers) or "none")


def format_projects(projects: list[dict[str, Any]]) -> str:
    if not projects:
        return "you are in no project; ask an admin to add you (`ftq projects add-member PROJECT USER`)"
    rows = [HEADER, *((p["name"], p["role"] or "-", "yes" if p["default"] else "", str(p["max_gpus"])
                       if p["max_gpus"] is not None else "-", p["max_priority"] or "-", _servers_cell(p))
                      for p in projects)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
