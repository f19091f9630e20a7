"""``ftq models``: the models this box can train, and ``ftq models pull`` to bring one in.

    ftq models                          the model root's models (``GET /v1/models``): name (what a
                                        job's ``model`` takes), size, architecture, parameters, and
                                        whether LoRA / full fine-tuning fit the live workers' GPUs
    ftq models pull ORG/NAME [--revision REV] [--model-root DIR]
                                        download a model from the Hugging Face hub into
                                        ``<model root>/ORG/NAME`` (``cli.pull``: resumable, checked)

The pull runs in this process, on the box (``cli.pull`` says why), into the model root the API
reports (``GET /v1/models``' ``model_root``) when that directory is on this machine, into
``FTQ_MODEL_ROOT`` (or its default) when no API answers, or into ``--model-root``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from cli import config
from cli.client import call, check, connect
from cli.errors import CliError
from cli.pull import format_bytes, pull

HEADER = ("NAME", "SIZE", "ARCHITECTURE", "PARAMS", "LORA", "FULL")


def add_parsers(commands: Any) -> None:
    parser = commands.add_parser("models", help="the models this box can train; `ftq models pull ORG/NAME` brings one in",
                                 description="Without a command: list the model root's models and whether they fit the GPUs.")
    parser.set_defaults(run=run_list)
    sub = parser.add_subparsers(dest="models_command", metavar="MODELS_COMMAND")
    p = sub.add_parser("pull", help="download a model from the Hugging Face hub into the model root (resumable)")
    p.add_argument("repo_id", metavar="ORG/NAME", help="the hub id, e.g. Qwen/Qwen3-0.6B")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    p.add_argument("--model-root", help="where to put it (default: the API's model root, else FTQ_MODEL_ROOT)")
    p.set_defaults(run=run_pull)


def run_list(args: argparse.Namespace) -> int:
    with connect() as client:
        body = call(client, "GET", "/v1/models").json()
    print(format_models(body["data"], body["model_root"]))
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from core.jobs.model_source import HUB_ID

    if not HUB_ID.match(args.repo_id):
        raise CliError(f"{args.repo_id!r} is not a hub id; name it as ORG/NAME (e.g. Qwen/Qwen3-0.6B)")
    # huggingface_hub's HTTP client logs every request at INFO, as httpx does (cli.main quiets that one)
    logging.getLogger("httpx2").setLevel(max(logging.WARNING, logging.getLogger().level))
    root = Path(args.model_root).expanduser().resolve() if args.model_root else model_root()
    target = pull(args.repo_id, root, revision=args.revision, token=hub_token(),
                  endpoint=os.environ.get("HF_ENDPOINT") or None)
    print(f"{args.repo_id}: installed in {target}; a job names it as model: {args.repo_id}", file=sys.stderr)
    return 0


def format_models(models: list[dict[str, Any]], root: str) -> str:
    """The models as a table, then each model's warning, each ``no`` fit's reason and why a fit
    is unknown."""
    if not models:
        return f"no models under {root}; pull one with `ftq models pull ORG/NAME`"
    rows = [HEADER, *(_row(m) for m in models)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip() for row in rows]
    for m in models:
        if m.get("error"):
            lines.append(f"{m['id']}: warning: {m['error']}")
        lines.extend(f"{m['id']} {method}: {fit['reason']}" for method, fit in m["fit"].items() if fit["fits"] is False)
    unknown = {fit["reason"] for m in models for fit in m["fit"].values() if fit["fits"] is None}
    lines.extend(f"?: {reason}" for reason in sorted(unknown))
    return "\n".join(lines)


def _row(model: dict[str, Any]) -> tuple[str, ...]:
    return (
        model["id"],
        format_bytes(model["bytes"]),
        ", ".join(model["architectures"]) or model.get("model_type") or "-",
        format_count(model["params"]) if model["params"] is not None else "-",
        _fit_cell(model["fit"]["lora"]),
        _fit_cell(model["fit"]["full"]),
    )


def _fit_cell(fit: dict[str, Any]) -> str:
    if fit["fits"] is None:
        return "?"
    if not fit["fits"]:
        return "no"
    return "yes" if fit["gpus"] == 1 else f"yes ({fit['gpus']} GPUs)"


def format_count(count: int) -> str:
    """``596.0M``, ``8.0B``: parameters as people say them."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return str(count)


def hub_token() -> str | None:
    """``HF_TOKEN``, else the config file's ``hf_token``; None leaves huggingface_hub to its own login."""
    return os.environ.get("HF_TOKEN") or config.load_config().get("hf_token") or None


def model_root() -> Path:
    """The API's model root when it answers and the directory is on this machine; with no API
    running, ``FTQ_MODEL_ROOT`` (or its default): the root ``ftq up`` will use.

    Raises:
        CliError: the API answers with an error, or its model root is not a directory here.
    """
    from core.settings import Settings

    with connect() as client:
        try:
            response = client.get("/v1/models")
        except httpx.TransportError:
            return Settings().resolved().model_root
    check(response)
    root = Path(response.json()["model_root"])
    if not root.is_dir():
        raise CliError(f"the ftq API at {client.base_url} keeps its models in {root}, which is not a directory on "
                       "this machine; run `ftq models pull` on the box the API runs on, or pass --model-root DIR")
    return root
