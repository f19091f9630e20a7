"""``ftq eval lm-eval EVAL MODEL TASK.yaml``: an lm-evaluation-harness task defined locally (its YAML
and a JSONL of its documents) run as an eval run (``data_source.type: lm_eval``, docs/evals.md).

The YAML is read here: its documents come from ``--items`` (a JSONL file or a file id) or from the
file it names itself (``dataset_path: json``, ``dataset_kwargs.data_files``, relative to the YAML's
folder or the current one; the split ``test_split`` names, else the only one). They are uploaded
with ``purpose=evals`` and the task goes to the API without its dataset keys (the box downloads
nothing). A task of another ``dataset_path`` (a hub dataset) is refused here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from cli import config
from cli.client import call, connect
from cli.errors import CliError
from cli.jobs import FILE_ID, upload

DATASET_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs", "training_split", "validation_split", "test_split",
                "fewshot_split")


def add_parser(sub: Any, run_cmd: Any) -> None:
    p = sub.add_parser("lm-eval", help="run an lm-eval task (a local YAML + JSONL) on a model as an eval run")
    p.add_argument("eval_id")
    p.add_argument("model", help="a base, job:<id>, job:<id>@<step>, an ft: name or export:<id>")
    p.add_argument("task", type=Path, help="the task's YAML (dataset_path: json with a local data_files)")
    p.add_argument("--items", help="the documents (JSONL, one object per line, or a file id) instead of "
                   "the YAML's data_files")
    p.add_argument("--name")
    p.add_argument("--no-wait", action="store_true", help="only queue the run; print its id")
    p.set_defaults(run=lambda args: run_cmd(args, run_lm_eval))


def load_task(path: Path) -> tuple[dict[str, Any], Path | None]:
    """``(the task without its dataset keys, the local documents file it names or None)``."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CliError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise CliError(f"{path}: not YAML ftq reads ({exc}); !function and other tags (Python code) are not "
                       "supported") from None
    if not isinstance(raw, dict):
        raise CliError(f"{path}: a task YAML is a mapping (task, output_type, doc_to_text, ...)")
    task = {k: v for k, v in raw.items() if k not in DATASET_KEYS}
    if "dataset_path" not in raw:
        return task, None
    if raw["dataset_path"] != "json":
        raise CliError(f"{path}: dataset_path {raw['dataset_path']!r}: ftq runs tasks on local documents only "
                       "(dataset_path: json with dataset_kwargs.data_files, or --items FILE.jsonl)")
    files = (raw.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        split = raw.get("test_split") or (next(iter(files)) if len(files) == 1 else None)
        files = files.get(split) if split else None
    if isinstance(files, list) and len(files) == 1:
        files = files[0]
    if not isinstance(files, str):
        raise CliError(f"{path}: dataset_kwargs.data_files: name one JSONL file (for test_split), or pass --items")
    for base in (path.parent, Path.cwd()):
        if (base / files).is_file():
            return task, base / files
    raise CliError(f"{path}: data_files {files!r} is not a file (relative to {path.parent} or the current folder)")


def run_lm_eval(args: argparse.Namespace, wait: Any) -> dict[str, Any]:
    """Upload the documents, queue the run; the run object (``wait(client, eval_id, run_id)`` for it
    to finish unless ``--no-wait``)."""
    task, data = load_task(args.task)
    items = args.items
    if items is None and data is None:
        raise CliError(f"{args.task}: no documents: give the YAML dataset_path: json with data_files, or --items")
    with connect() as client:
        if items is None or not FILE_ID.match(items):
            path = Path(items).expanduser() if items is not None else data
            assert path is not None
            if not path.is_file():
                raise CliError(f"--items: {items!r} is neither a file id nor a readable file")
            items = upload(client, path, "evals", config.default_project())["id"]
        body = {"data_source": {"type": "lm_eval", "model": args.model, "task": task,
                                "source": {"type": "file_id", "id": items}}, **({"name": args.name} if args.name else {})}
        run = call(client, "POST", f"/v1/evals/{args.eval_id}/runs", json=body).json()
        print(run["id"], flush=True)
        if args.no_wait:
            return run
        print(f"job {run['job_id']}: follow it with ftq logs {run['job_id']} --follow", file=sys.stderr)
        return wait(client, args.eval_id, run["id"])
