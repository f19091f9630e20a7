"""Client commands: ``ftq generate MODEL PROMPTS`` and ``ftq completions JOB``.

``generate`` uploads the prompts file (``purpose=generate``; a file id is used as it is), submits
a generation job (``POST /v1/jobs`` with ``kind: generate``), follows it as ``ftq logs --follow``
does (a progress line per chunk) and downloads ``completions.jsonl``; it prints the job id first
and the written path last. ``--no-wait`` prints the job id only. A cancelled job continues with
``ftq resume JOB`` (the same job, from the first undone prompt); ``ftq completions JOB`` downloads
its output then, or ``--head N`` prints the first lines written so far.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from cli import config
from cli.client import call, connect
from cli.client import download as client_download
from cli.errors import CliError
from cli.jobs import FILE_ID, follow, prompts_cell, upload


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("generate", help="complete a prompts file with a model (a batch generation job)")
    p.add_argument("model", help="a base under the model root or hub id, job:<id>, job:<id>@<step> or export:<id>")
    p.add_argument("prompts", help='a JSONL file ({"messages": [...]} or {"prompt": "..."} per line) or a file id')
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("-n", type=int, help="completions per prompt")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    p.add_argument("--logprobs", action="store_true", help="each token's log-probability in the output")
    p.add_argument("--top-logprobs", type=int)
    p.add_argument("--gpus", type=int, help="split the prompts over N GPUs of one host")
    p.add_argument("--chunk-prompts", type=int, help="prompts written together (what a cancel redoes at most)")
    p.add_argument("--priority", choices=("low", "normal", "high"))
    p.add_argument("--name")
    p.add_argument("--project")
    p.add_argument("-o", "--output", type=Path, help="where to write completions.jsonl (default <job>-completions.jsonl)")
    p.add_argument("--no-wait", action="store_true", help="only submit; print the job id")
    p.set_defaults(run=run_generate)

    p = commands.add_parser("completions", help="a generation job's completions.jsonl")
    p.add_argument("job_id")
    p.add_argument("-o", "--output", type=Path, help="file to write (default <job>-completions.jsonl; - for stdout)")
    p.add_argument("--head", type=int, metavar="N", help="print the first N lines written so far instead")
    p.set_defaults(run=run_completions)


_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "top_logprobs")


def spec_of(args: argparse.Namespace, prompts_file: str) -> dict[str, Any]:
    """The ``POST /v1/jobs`` body the flags ask for (unset flags keep the API's defaults)."""
    sampling = {name: getattr(args, name) for name in _SAMPLING if getattr(args, name) is not None}
    if args.logprobs:
        sampling["logprobs"] = True
    body: dict[str, Any] = {"kind": "generate", "model": args.model, "prompts_file": prompts_file,
                            "sampling": sampling}
    for name in ("gpus", "chunk_prompts", "priority", "name", "project"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    return body


def run_generate(args: argparse.Namespace) -> int:
    project = args.project or config.default_project()
    args.project = project
    with connect() as client:
        prompts = args.prompts
        if not FILE_ID.match(prompts):
            path = Path(prompts).expanduser()
            if not path.is_file():
                raise CliError(f"prompts: {prompts!r} is neither a file id nor a readable file")
            prompts = upload(client, path, "generate", project)["id"]
        headers = {"Idempotency-Key": f"cli-{uuid.uuid4().hex}"}
        job = call(client, "POST", "/v1/jobs", json=spec_of(args, prompts), headers=headers).json()
        print(job["id"], flush=True)
        if args.no_wait:
            return 0
        if follow(client, job["id"], sys.stderr) != 0:  # events on stderr: stdout holds the id and the path
            return 1
        out = args.output or Path(f"{job['id']}-completions.jsonl")
        download(client, job["id"], out)
    print(out)
    return 0


def download(client: httpx.Client, job_id: str, out: Path) -> None:
    """Stream the job's completions.jsonl to ``out`` (through ``out.part``; ``-``: stdout)."""
    if str(out) == "-":
        print(call(client, "GET", f"/v1/jobs/{job_id}/completions").text, end="")
        return
    client_download(client, f"/v1/jobs/{job_id}/completions", out)


def run_completions(args: argparse.Namespace) -> int:
    with connect() as client:
        if args.head is not None:
            lines = call(client, "GET", f"/v1/jobs/{args.job_id}/completions/preview",
                         params={"limit": args.head}).json()["data"]
            for line in lines:
                print(json.dumps(line, ensure_ascii=False))
            return 0
        out = args.output or Path(f"{args.job_id}-completions.jsonl")
        download(client, args.job_id, out)
    if str(out) != "-":
        print(out)
    return 0


def format_generation_job(job: dict[str, Any]) -> str:
    """``ftq show`` of a generation job: model, sampling, progress, error, and what to run next."""
    job_id, status = job["id"], job["status"]
    rows = [("model", f"{job['model']}, {job['gpus']} GPU{'s' if job['gpus'] != 1 else ''}, owner "
                      f"{job.get('owner') or '-'}, priority {job['priority']}"),
            ("prompts", f"{job['training_file']}; sampling {json.dumps(job['spec'].get('sampling', {}))}"),
            ("progress", prompts_cell(job) + (f", {job['generation']['tokens_per_s']:,.0f} tokens/s"
                                               if (job.get("generation") or {}).get("tokens_per_s") else ""))]
    if job.get("error"):
        rows.append(("error", f"{job['error']['code']}: {job['error'].get('message') or '(no message)'}"))
    if status == "succeeded":
        rows.append(("download", f"ftq completions {job_id} -o out.jsonl"))
    else:
        rows.append(("so far", f"ftq completions {job_id} --head 5"))
    if status in ("queued", "running"):
        rows.append(("cancel", f"ftq cancel {job_id}"))
    if status == "cancelled":
        rows.append(("resume", f"ftq resume {job_id}  (the same job, from the first undone prompt)"))
    rows.append(("logs", f"ftq logs {job_id}"))
    head = f"{job_id}" + (f'  "{job["name"]}"' if job.get("name") else "") + f"  {status} (generation)"
    return "\n".join([head, *(f"  {label:<12}{text}" for label, text in rows)])
