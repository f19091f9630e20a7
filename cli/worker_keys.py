"""``ftq workers key ...``: the keys workers on other machines use, through the API (admin).

    ftq workers key create NAME     prints the new worker key once (set it as FTQ_WORKER_KEY there)
    ftq workers key list            names, prefixes, state, last use and the workers using each
    ftq workers key revoke NAME     revoke (by name or prefix): its transfers get 401, its claims stop

They call ``/v1/workers/keys`` with the client's key (``FTQ_API_KEY`` or ``ftq login``), which
must be an admin's.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cli.client import call, connect

HEADER = ("NAME", "PREFIX", "STATE", "LAST USED", "WORKERS")


def add_parsers(commands: Any) -> None:
    parser = commands.add_parser("workers", help="workers on other machines: their keys (admin, through the API)")
    sub = parser.add_subparsers(dest="workers_command", required=True, metavar="WORKERS_COMMAND")
    key = sub.add_parser("key", help="make, list and revoke worker keys")
    keys = key.add_subparsers(dest="key_command", required=True, metavar="KEY_COMMAND")

    p = keys.add_parser("create", help="make a worker key and print it (shown once)")
    p.add_argument("name", help="the key's name, e.g. the machine it is for")
    p.set_defaults(run=run_create)

    p = keys.add_parser("list", help="worker keys (never the secrets) and the workers using them")
    p.set_defaults(run=run_list)

    p = keys.add_parser("revoke", help="revoke a worker key by name or prefix")
    p.add_argument("name")
    p.set_defaults(run=run_revoke)


def run_create(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    with connect() as client:
        body = call(client, "POST", "/v1/workers/keys", json={"name": args.name}).json()
    print(f"worker key {body['name']} (shown once; the store keeps only its hash):\n\n    {body['key']}\n", file=out)
    print("On the worker's machine:  export FTQ_WORKER_KEY=<key> FTQ_API_URL=<this API's URL>", file=out, flush=True)
    return 0


def run_list(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    with connect() as client:
        data = call(client, "GET", "/v1/workers/keys").json()["data"]
    print(format_keys(data), file=out)
    return 0


def run_revoke(args: argparse.Namespace, out: Any = None) -> int:
    out = out or sys.stdout
    with connect() as client:
        body = call(client, "DELETE", f"/v1/workers/keys/{args.name}").json()
    print(f"revoked worker key {body['name']} ({body['prefix']}) at {body['revoked_at']}", file=out)
    return 0


def format_keys(keys: list[dict[str, Any]]) -> str:
    if not keys:
        return "no worker keys; make one with `ftq workers key create NAME`"
    rows = [HEADER, *(
        (k["name"], k["prefix"], "revoked" if k["revoked_at"] else "active", k["last_used_at"] or "never",
         ", ".join(k.get("workers") or []) or "-")
        for k in keys
    )]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows
    )
