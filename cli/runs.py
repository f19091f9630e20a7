"""Client commands on a job's runs: ``rerun`` (clone with changes), ``resume``, ``metrics`` (CSV).

``ftq rerun JOB --set hyperparameters.learning_rate=1e-4 --set name="lr 1e-4"`` submits a copy of
JOB's stored spec with those fields changed (``POST /v1/jobs/{id}/clone``). A key without a dot
that is not a top-level job field but a field of ``hyperparameters`` or ``lora`` (read from the
API's own schema) means that one: ``--set learning_rate=1e-4``. Values are YAML scalars or lists
(``3``, ``2e-4``, ``true``, ``[q_proj, v_proj]``); ``null`` restores a field's default.

``ftq resume JOB [--step N]`` continues a failed or cancelled JOB as a new job from its checkpoint
at step N (default its newest).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

from cli.client import call, connect
from cli.errors import CliError
from cli.jobs import follow, queue_line

NESTED = ("hyperparameters", "lora")


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("rerun", help="submit a copy of a job, with --set changes")
    p.add_argument("job_id")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a field to change, e.g. learning_rate=1e-4 or lora.r=32 (repeatable)")
    p.add_argument("--follow", action="store_true", help="then stream its progress until it ends")
    p.add_argument("--project", help="the project the copy goes to (default: the source job's)")
    p.set_defaults(run=run_rerun)

    p = commands.add_parser("resume", help="continue a failed or cancelled job from a checkpoint, as a new job")
    p.add_argument("job_id")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    p.add_argument("--follow", action="store_true", help="then stream its progress until it ends")
    p.set_defaults(run=run_resume)

    p = commands.add_parser("metrics", help="download a job's step metrics as CSV")
    p.add_argument("job_id")
    p.add_argument("-o", "--output", type=Path, help="file to write (default <job>-metrics.csv; - for stdout)")
    p.set_defaults(run=run_metrics)


def parse_sets(sets: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    """``["learning_rate=1e-4", "lora.r=32"]`` → ``{"hyperparameters": {"learning_rate": 1e-4}, "lora": {"r": 32}}``."""
    import yaml

    overrides: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--set {item!r}: write KEY=VALUE, e.g. --set learning_rate=1e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise CliError(f"--set {item!r}: the value is not a YAML scalar or list ({exc})") from exc
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as text
            try:
                value = float(value)
            except ValueError:
                pass
        node = overrides
        *parents, leaf = qualify(key.strip(), schema).split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return overrides


def qualify(key: str, schema: dict[str, Any]) -> str:
    """A bare hyperparameter or LoRA field name, prefixed with its section; other keys as given."""
    if "." in key:
        return key
    schemas = schema.get("components", {}).get("schemas", {})
    if key in schemas.get("JobSpec", {}).get("properties", {}):
        return key
    for section, name in (("hyperparameters", "Hyperparameters"), ("lora", "LoraSpec")):
        if key in schemas.get(name, {}).get("properties", {}):
            return f"{section}.{key}"
    return key  # the API names what is unknown


def _submitted(client: httpx.Client, job: dict[str, Any], follow_it: bool) -> int:
    """The new job's id on stdout; its preflight's warnings (a rerun is checked as a new job) and
    its place in the queue on stderr, as ``ftq submit`` prints them."""
    print(job["id"])
    for warning in (job.get("preflight") or {}).get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)
    if job.get("queue"):
        print(queue_line(job["queue"]), file=sys.stderr)
    return follow(client, job["id"], sys.stdout) if follow_it else 0


def rerun(client: httpx.Client, job_id: str, sets: list[str], project: str | None = None) -> dict[str, Any]:
    """Submit a copy of ``job_id`` with the ``--set`` changes (into ``project``, else the
    source's); returns the new job."""
    schema = call(client, "GET", "/openapi.json").json() if sets else {}
    overrides = {**parse_sets(sets, schema), **({"project": project} if project else {})}
    return call(client, "POST", f"/v1/jobs/{job_id}/clone", json=overrides).json()


def resume(client: httpx.Client, job_id: str, step: int | None) -> dict[str, Any]:
    """Continue ``job_id`` from its checkpoint at ``step`` (None: the newest); returns the new job."""
    return call(client, "POST", f"/v1/jobs/{job_id}/resume", json={"step": step} if step is not None else None).json()


def run_rerun(args: argparse.Namespace) -> int:
    with connect() as client:
        return _submitted(client, rerun(client, args.job_id, args.sets, args.project), args.follow)


def run_resume(args: argparse.Namespace) -> int:
    with connect() as client:
        return _submitted(client, resume(client, args.job_id, args.step), args.follow)


def run_metrics(args: argparse.Namespace) -> int:
    with connect() as client:
        text = call(client, "GET", f"/v1/jobs/{args.job_id}/metrics.csv").text
    if args.output == Path("-"):
        sys.stdout.write(text)
        return 0
    target = args.output or Path(f"{args.job_id}-metrics.csv")
    target.write_text(text, encoding="utf-8")
    print(f"wrote {target} ({max(0, text.count(chr(10)) - 1):,} steps)")
    return 0
