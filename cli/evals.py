"""Client commands: ``ftq eval create|list|show|run|lm-eval|results|cancel|delete`` over ``/v1/evals``.

``ftq eval create EVAL.json`` stores an eval (the body of ``evals.create``: ``data_source_config``
with an ``item_schema``, ``testing_criteria``, ``name``) and prints its id. ``ftq eval run EVAL
MODEL ITEMS.jsonl --template 'user:{{item.question}}'`` uploads the items (``purpose=evals``; a
file id is used as it is), queues a run on MODEL (a base, ``job:<id>``, ``job:<id>@<step>``, an
``ft:`` name, ``export:<id>``), waits for it and prints its results; ``--no-wait`` prints the run
id only. ``ftq eval lm-eval EVAL MODEL TASK.yaml`` runs a local lm-eval task (``cli.evals_lm``).
``ftq eval results EVAL RUN [--items] [--status fail]`` prints a run's counts, and with
``--items`` each item's output and scores. See docs/evals.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cli import config, evals_lm
from cli.client import call, connect
from cli.errors import CliError
from cli.jobs import FILE_ID, upload

FINISHED = ("completed", "failed", "canceled")


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("eval", help="evals: graders over a model's answers to a set of items")
    sub = p.add_subparsers(dest="eval_command", required=True)
    c = sub.add_parser("create", help="store an eval from a JSON file (evals.create's body); prints its id")
    c.add_argument("file", type=Path)
    c.add_argument("--project")
    c.set_defaults(run=run_create)
    sub.add_parser("list", help="the evals you can read").set_defaults(run=run_list)
    s = sub.add_parser("show", help="an eval, its criteria and its runs' results")
    s.add_argument("eval_id")
    s.set_defaults(run=run_show)
    r = sub.add_parser("run", help="run an eval on a model: generate for each item, grade, print the results")
    r.add_argument("eval_id")
    r.add_argument("model", help="a base, job:<id>, job:<id>@<step>, an ft: name or export:<id>")
    r.add_argument("items", help='a JSONL file ({"item": {...}} per line) or a file id')
    r.add_argument("--template", action="append", required=True, metavar="ROLE:TEXT",
                   help="an input message, e.g. 'user:{{item.question}}' (repeat for several, in order)")
    r.add_argument("--max-tokens", type=int)
    r.add_argument("--temperature", type=float)
    r.add_argument("--top-p", type=float)
    r.add_argument("--seed", type=int)
    r.add_argument("--name")
    r.add_argument("--no-wait", action="store_true", help="only queue the run; print its id")
    r.set_defaults(run=run_run)
    evals_lm.add_parser(sub, _finish)
    o = sub.add_parser("results", help="a run's counts; --items: each item's output and scores")
    o.add_argument("eval_id")
    o.add_argument("run_id")
    o.add_argument("--items", action="store_true")
    o.add_argument("--status", choices=("pass", "fail", "error"))
    o.set_defaults(run=run_results)
    c = sub.add_parser("cancel", help="cancel a queued or running run")
    c.add_argument("eval_id")
    c.add_argument("run_id")
    c.set_defaults(run=run_cancel)
    d = sub.add_parser("delete", help="delete an eval (or, with a run id, one finished run)")
    d.add_argument("eval_id")
    d.add_argument("run_id", nargs="?")
    d.set_defaults(run=run_delete)


def template_of(specs: list[str]) -> dict[str, Any]:
    """``--template ROLE:TEXT`` flags as ``input_messages``."""
    messages = []
    for spec in specs:
        role, sep, text = spec.partition(":")
        if not sep or role not in ("system", "developer", "user", "assistant"):
            raise CliError(f"--template {spec!r}: write ROLE:TEXT, ROLE one of system, developer, user, assistant")
        messages.append({"role": role, "content": text})
    return {"type": "template", "template": messages}


def run_body(args: argparse.Namespace, file_id: str) -> dict[str, Any]:
    """The ``POST /v1/evals/{id}/runs`` body the flags ask for."""
    sampling = {key: value for key, value in (("max_completion_tokens", args.max_tokens),
                                              ("temperature", args.temperature), ("top_p", args.top_p),
                                              ("seed", args.seed)) if value is not None}
    source = {"type": "completions", "model": args.model, "source": {"type": "file_id", "id": file_id},
              "input_messages": template_of(args.template)}
    if sampling:
        source["sampling_params"] = sampling
    return {"data_source": source, **({"name": args.name} if args.name else {})}


def run_create(args: argparse.Namespace) -> int:
    try:
        body = json.loads(args.file.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"{args.file}: {exc}") from None
    project = args.project or config.default_project()
    if project:
        body["project"] = project
    with connect() as client:
        print(call(client, "POST", "/v1/evals", json=body).json()["id"])
    return 0


def run_list(args: argparse.Namespace) -> int:
    with connect() as client:
        for ev in call(client, "GET", "/v1/evals", params={"limit": 100, "order": "desc"}).json()["data"]:
            print(f"{ev['id']}  {ev['name']}  {len(ev['testing_criteria'])} criteria")
    return 0


def run_show(args: argparse.Namespace) -> int:
    with connect() as client:
        ev = call(client, "GET", f"/v1/evals/{args.eval_id}").json()
        runs = call(client, "GET", f"/v1/evals/{args.eval_id}/runs", params={"limit": 100}).json()["data"]
    print(f"{ev['id']}  {ev['name']}")
    for criterion in ev["testing_criteria"]:
        print(f"  criterion  {criterion['name']} ({criterion['type']})")
    for run in runs:
        print(format_run(run))
    return 0


def format_run(run: dict[str, Any]) -> str:
    """One run: status, model, counts and each criterion's pass rate."""
    counts = run["result_counts"]
    head = (f"{run['id']}  {run['status']}  {run['model']}  passed {counts['passed']}/{counts['total']}"
            f" (failed {counts['failed']}, errored {counts['errored']})")
    rates = [f"    {r['testing_criteria']}: {r['passed']} passed, {r['failed']} failed"
             + (f", mean score {r['mean_score']:.3f}" if r.get("mean_score") is not None else "")
             for r in run["per_testing_criteria_results"]]
    return "\n".join([head, *rates])


def wait(client: httpx.Client, eval_id: str, run_id: str) -> dict[str, Any]:
    run = call(client, "GET", f"/v1/evals/{eval_id}/runs/{run_id}").json()
    while run["status"] not in FINISHED:
        time.sleep(1.0)
        run = call(client, "GET", f"/v1/evals/{eval_id}/runs/{run_id}").json()
    return run


def run_run(args: argparse.Namespace) -> int:
    with connect() as client:
        items = args.items
        if not FILE_ID.match(items):
            path = Path(items).expanduser()
            if not path.is_file():
                raise CliError(f"items: {items!r} is neither a file id nor a readable file")
            items = upload(client, path, "evals", config.default_project())["id"]
        run = call(client, "POST", f"/v1/evals/{args.eval_id}/runs", json=run_body(args, items)).json()
        print(run["id"], flush=True)
        if args.no_wait:
            return 0
        print(f"job {run['job_id']}: follow it with ftq logs {run['job_id']} --follow", file=sys.stderr)
        run = wait(client, args.eval_id, run["id"])
    print(format_run(run))
    return 0 if run["status"] == "completed" else 1


def _finish(args: argparse.Namespace, start: Any) -> int:
    """Run ``start(args)`` (a run object) and print the run: its id alone with ``--no-wait``."""
    run = start(args, wait)
    if args.no_wait:
        return 0
    print(format_run(run))
    return 0 if run["status"] == "completed" else 1


def run_results(args: argparse.Namespace) -> int:
    with connect() as client:
        run = call(client, "GET", f"/v1/evals/{args.eval_id}/runs/{args.run_id}").json()
        print(format_run(run))
        if not args.items:
            return 0
        params: dict[str, Any] = {"limit": 100, **({"status": args.status} if args.status else {})}
        path = f"/v1/evals/{args.eval_id}/runs/{args.run_id}/output_items"
        while True:
            page = call(client, "GET", path, params=params).json()
            for item in page["data"]:
                print(format_item(item))
            if not page["has_more"]:
                return 0
            params["after"] = page["last_id"]


def format_item(item: dict[str, Any]) -> str:
    """One output item: index, status, the model's output and each score."""
    output = item["sample"]["output"][0]["content"] if item["sample"]["output"] else ""
    scores = ", ".join(f"{r['name']} {r['score']:g}{'' if r['passed'] else ' ✗'}" for r in item["results"])
    return f"  #{item['datasource_item_id']}  {item['status']}  {json.dumps(output, ensure_ascii=False)[:80]}  {scores}"


def run_cancel(args: argparse.Namespace) -> int:
    with connect() as client:
        print(call(client, "POST", f"/v1/evals/{args.eval_id}/runs/{args.run_id}/cancel").json()["status"])
    return 0


def run_delete(args: argparse.Namespace) -> int:
    path = f"/v1/evals/{args.eval_id}" + (f"/runs/{args.run_id}" if args.run_id else "")
    with connect() as client:
        call(client, "DELETE", path)
    print("deleted")
    return 0
