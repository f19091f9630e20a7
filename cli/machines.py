"""``ftq machines``: the machines of the box and their GPUs (``GET /v1/hardware``'s ``machines``).

One line per machine: its name and address, ``live`` or ``LOST`` (none of its workers has beaten
for longer than ``FTQ_HEARTBEAT_TIMEOUT_S``: the reaper requeues its running jobs and frees its
GPUs), local or remote (a worker key), its newest heartbeat's age, and each GPU with the job
holding it (``0:job-…``) or ``free``.
"""

from __future__ import annotations

import argparse
from typing import Any

from cli.client import call, connect

HEADER = ("MACHINE", "ADDRESS", "STATUS", "WORKERS", "HEARTBEAT", "GPUS")


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("machines", help="the machines running workers: live or lost, their GPUs and jobs")
    p.set_defaults(run=run_machines)


def run_machines(args: argparse.Namespace) -> int:
    with connect() as client:
        body = call(client, "GET", "/v1/hardware").json()
    print(format_machines(body.get("machines", [])))
    return 0


def format_machines(machines: list[dict[str, Any]]) -> str:
    """The machines as a table; an empty box says how to start a worker."""
    if not machines:
        return "no worker has registered; start one with `ftq worker --gpus all` (or `ftq up`)"
    rows = [HEADER, *(_row(m) for m in machines)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows
    )


def _row(machine: dict[str, Any]) -> tuple[str, ...]:
    gpus = " ".join(f"{_gpu_name(g)}:{g['job'] or 'free'}" for g in machine["gpus"]) or "-"
    return (
        machine["name"],
        machine.get("address") or "-",
        "LOST" if machine["status"] == "lost" else "live",
        f"{len(machine['workers'])} {'remote' if machine['remote'] else 'local'}",
        f"{machine['heartbeat_age_s']:.0f}s ago",
        gpus,
    )


def _gpu_name(gpu: dict[str, Any]) -> str:
    return str(gpu["device"]) if gpu.get("device") is not None else f"slot{gpu['slot']}"
