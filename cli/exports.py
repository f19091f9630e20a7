"""Client commands: ``ftq export JOB --format merged|gguf`` and ``ftq exports JOB``.

``export`` asks the API for the export (``POST /v1/jobs/{id}/exports``), follows its progress
on stderr and downloads the result: a zip of the merged model, or the ``.gguf`` file.
``--no-wait`` only asks and prints the export as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cli.client import call, connect
from cli.client import download as client_download
from cli.errors import CliError
from trainer.catalog import DEFAULT_QUANTIZATION, EXPORT_FORMATS, QUANTIZATIONS

POLL_S = 1.0


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("export", help="export a finished job: merged safetensors or GGUF, then download it")
    p.add_argument("job_id")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--quantization", choices=QUANTIZATIONS, help=f"gguf tensor type (default {DEFAULT_QUANTIZATION})")
    p.add_argument("-o", "--output", type=Path, help="file to write (default <job>-<format>[-<quantization>].zip|.gguf)")
    p.add_argument("--no-wait", action="store_true", help="only ask for it; print the export as JSON")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds to wait for it (default 6 h)")
    p.set_defaults(run=run_export)

    p = commands.add_parser("exports", help="a job's exports")
    p.add_argument("job_id")
    p.set_defaults(run=run_exports)


def run_export(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"format": args.format}
    if args.quantization:
        if args.format != "gguf":
            raise CliError("--quantization is for --format gguf only")
        body["quantization"] = args.quantization
    with connect() as client:
        export = call(client, "POST", f"/v1/jobs/{args.job_id}/exports", json=body).json()
        if args.no_wait:
            print(json.dumps(export, indent=2))
            return 0
        export = wait(client, export, timeout_s=args.timeout)
        if export["status"] != "succeeded":
            raise CliError(f"export {export['id']} failed ({export['error_code']}): {export['error_message']}")
        out = args.output or Path(default_name(export))
        download(client, export, out)
    print(out)
    return 0


def wait(client: httpx.Client, export: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Poll until the export has finished, drawing one progress line on stderr."""
    deadline = time.monotonic() + timeout_s
    path = f"/v1/jobs/{export['job_id']}/exports/{export['id']}"
    while export["status"] in ("queued", "running"):
        if time.monotonic() > deadline:
            raise CliError(f"export {export['id']} is still {export['status']} after {timeout_s:g}s; "
                           f"`ftq exports {export['job_id']}` shows it")
        stage = export.get("stage") or export["status"]
        print(f"\rexport {export['id']}: {stage:<8} {100 * export['progress']:5.1f}%", end="", file=sys.stderr)
        time.sleep(POLL_S)
        export = call(client, "GET", path).json()
    print(file=sys.stderr)
    return export


def default_name(export: dict[str, Any]) -> str:
    stem = f"{export['job_id']}-{export['format']}" + (f"-{export['quantization']}" if export["quantization"] else "")
    return stem + (".gguf" if export["format"] == "gguf" else ".zip")


def download(client: httpx.Client, export: dict[str, Any], out: Path) -> None:
    """Stream the export to ``out`` (through ``out.part``, renamed when complete)."""
    client_download(client, export["download_url"], out)


def run_exports(args: argparse.Namespace) -> int:
    with connect() as client:
        rows = call(client, "GET", f"/v1/jobs/{args.job_id}/exports").json()["data"]
    print(f"{'ID':<30} {'FORMAT':<12} {'STATUS':<10} {'PROGRESS':>8} {'BYTES':>14}")
    for row in rows:
        kind = row["format"] + (f"/{row['quantization']}" if row["quantization"] else "")
        print(f"{row['id']:<30} {kind:<12} {row['status']:<10} {100 * row['progress']:7.1f}% {row['bytes'] or '-':>14}")
    return 0
