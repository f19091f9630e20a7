"""Client commands: ``submit``, ``jobs``, ``show``, ``logs``, ``cancel``, ``download``.

``ftq submit job.yaml`` sends the file's body as ``POST /v1/jobs`` (YAML or JSON, the API's
job fields; YAML numbers read as YAML 1.2 and JSON read them, so ``learning_rate: 5e-4`` is a
number, not PyYAML's string). ``training_file`` / ``validation_file`` may name a local JSONL
file instead of a file id: it is uploaded first (purpose ``train`` / ``validation``; as
``format=prompts`` for ``objective: grpo``), so one file describes a whole run. The job id goes
to stdout; the preflight's warnings to stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
import unicodedata
import uuid
from pathlib import Path
from typing import Any, TextIO

import httpx

from cli import config, projects
from cli.client import call, check, connect, sse_events
from cli.errors import CliError

FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""``5e-4``, ``1E6``: floats in YAML 1.2 and JSON; PyYAML's YAML 1.1 rules want a dot (``5.0e-4``)."""
FINISHED = ("succeeded", "failed", "cancelled")


def add_parsers(commands: Any) -> None:
    p = commands.add_parser("submit", help="submit a job from a YAML/JSON file")
    p.add_argument("job_file", type=Path, help="the job: model, training_file (id or local path), ...")
    p.add_argument("--follow", action="store_true", help="then stream its progress until it ends")
    p.add_argument("--priority", choices=["low", "normal", "high"], help="queue priority (overrides the file's)")
    projects.add_project_flag(p, "the project the job and its uploads go to (overrides the file's)")
    p.set_defaults(run=run_submit)

    p = commands.add_parser("jobs", help="list jobs, newest first")
    p.add_argument("--status", help="only these statuses, comma-separated (e.g. queued,running)")
    p.add_argument("--owner", help="only this user's jobs ('me' for yours)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--search", "-q", help="only jobs whose name, model or owner contains this text")
    p.add_argument("--project", help="only this project's jobs (default: all of your projects')")
    p.set_defaults(run=run_jobs)

    p = commands.add_parser("show", help="one job: state, progress, losses, plan, error, what to download")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="the API's job object as JSON instead")
    p.set_defaults(run=run_show)

    p = commands.add_parser("logs", help="a job's events; --follow streams them live with a progress line")
    p.add_argument("job_id")
    p.add_argument("--follow", "-f", action="store_true", help="keep streaming until the job ends")
    p.set_defaults(run=run_logs)

    p = commands.add_parser("cancel", help="cancel a queued or running job")
    p.add_argument("job_id")
    p.set_defaults(run=run_cancel)

    p = commands.add_parser("download", help="download a job's final adapter (or a checkpoint)")
    p.add_argument("job_id")
    p.add_argument("--step", type=int, help="a checkpoint's step instead of the final adapter")
    p.add_argument("--format", choices=["zip", "tar.gz"], default="zip")
    p.add_argument("-o", "--output", type=Path, help="file to write (default <job>-adapter.<format>)")
    p.set_defaults(run=run_download)


def load_job_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CliError(f"{path}: no such file; write the job as YAML or JSON (see `ftq submit --help`)")
    import yaml

    text = path.read_text(encoding="utf-8")
    try:
        body = json.loads(text) if path.suffix == ".json" else read_yaml(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise CliError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from exc
    if not isinstance(body, dict):
        raise CliError(f"{path}: the job must be a mapping of fields (model, training_file, ...)")
    return body


def read_yaml(text: str) -> Any:
    """``yaml.safe_load`` that reads ``5e-4`` as a float (the API's job spec takes no numbers as strings)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader with one more float pattern


def submit(client: httpx.Client, body: dict[str, Any], *, base_dir: Path) -> dict[str, Any]:
    """Upload local dataset paths named in ``body`` (to the job's ``project``, if it names one),
    then create the job; returns the job."""
    body = dict(body)
    for key, purpose in (("training_file", "train"), ("validation_file", "validation")):
        value = body.get(key)
        if isinstance(value, str) and not FILE_ID.match(value):
            path = (base_dir / value).expanduser()
            if not path.is_file():
                raise CliError(f"{key}: {value!r} is neither a file id nor a readable file")
            layout = "prompts" if body.get("objective") == "grpo" else None  # a GRPO job trains on prompts
            body[key] = upload(client, path, purpose, body.get("project"), layout)["id"]
    # One key per submission: a retried request after a dropped connection makes no second job.
    headers = {"Idempotency-Key": f"cli-{uuid.uuid4().hex}"}
    return call(client, "POST", "/v1/jobs", json=body, headers=headers).json()


def upload(client: httpx.Client, path: Path, purpose: str, project: str | None = None,
           layout: str | None = None) -> dict[str, Any]:
    data = {"purpose": purpose, **({"project": project} if project else {}), **({"format": layout} if layout else {})}
    with path.open("rb") as f:
        return call(client, "POST", "/v1/files", files={"file": (path.name, f)}, data=data).json()


def run_submit(args: argparse.Namespace) -> int:
    body = load_job_file(args.job_file)
    if args.priority:
        body["priority"] = args.priority
    project = args.project or body.get("project") or config.default_project()
    if project:
        body["project"] = project
    with connect() as client:
        job = submit(client, body, base_dir=args.job_file.parent)
        print(job["id"])
        for warning in (job.get("preflight") or {}).get("warnings") or []:
            print(f"warning: {warning}", file=sys.stderr)
        if job.get("queue"):
            print(queue_line(job["queue"]), file=sys.stderr)
        if args.follow:
            return follow(client, job["id"], sys.stdout)
    return 0


def queue_line(queue: dict[str, Any]) -> str:
    """``queued at position 2 (1 ahead), estimated start 2026-11-22 04:10 UTC`` for people (and,
    for the head of the queue, whose GPUs it holds)."""
    ahead = len(queue.get("ahead") or [])
    start = queue.get("estimated_start_at")
    when = f"estimated start {start[:16].replace('T', ' ')} UTC" if start else "start time unknown"
    holds = f"; holding the free GPUs of {queue['holds']} until it starts" if queue.get("holds") else ""
    return f"queued at position {queue['position']} ({ahead} ahead), {when}{holds}"


def run_jobs(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.status:
        params["status"] = args.status
    if args.owner:
        params["owner"] = args.owner
    if args.search:
        params["q"] = args.search
    if args.project:
        params["project"] = args.project
    with connect() as client:
        jobs = call(client, "GET", "/v1/jobs", params=params).json()["data"]
    print(format_jobs(jobs))
    return 0


def format_jobs(jobs: list[dict[str, Any]], now: dt.datetime | None = None) -> str:
    """The jobs as a table; LOSS is the last step's train loss, BEST the lowest (eval loss when the
    job has a validation set, marked ``e``), TIME the run time so far."""
    rows = [("ID", "NAME", "STATUS", "STEP", "LOSS", "BEST", "TIME", "GPUS", "OWNER", "MODEL", "CREATED")]
    for job in jobs:
        progress = job["progress"]
        step = f"{progress['step']}/{progress['total_steps'] or '?'}" if job.get("kind") not in ("generate", "eval") else (
            prompts_cell(job, "p"))
        final, best = loss_cells(job)
        rows.append((job["id"], _clip(job.get("name") or "-", 24), job["status"], step, final, best,
                     duration_cell(job, now), gpus_cell(job), job.get("owner") or "-", job["model"],
                     job["created_at"][:19].replace("T", " ")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def prompts_cell(job: dict[str, Any], unit: str = " prompts") -> str:
    """``3/16 prompts`` for a generation job (``ftq jobs``' STEP column: ``3/16p``; ``ftq show``)."""
    state = job.get("generation") or {}
    total = state.get("prompts_total") or (job.get("preflight") or {}).get("records")
    return f"{state.get('prompts_done', 0)}/{total or '?'}{unit}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def loss_cells(job: dict[str, Any]) -> tuple[str, str]:
    """``(final train loss, best loss)`` as 4-digit text, ``-`` where none was recorded yet."""
    summary = job.get("summary") or {}
    final = summary.get("final_train_loss")
    best_eval = summary.get("best_eval_loss")
    best = f"{best_eval:.4f}e" if best_eval is not None else _num(summary.get("best_train_loss"))
    return _num(final), best


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def duration_cell(job: dict[str, Any], now: dt.datetime | None = None) -> str:
    """Run time: from start to the end (or to now while it runs), ``1h02m``, ``3m05s``, ``-`` if not started."""
    if not job.get("started_at"):
        return "-"
    start = dt.datetime.fromisoformat(job["started_at"])
    end = dt.datetime.fromisoformat(job["finished_at"]) if job.get("finished_at") else (now or dt.datetime.now(dt.UTC))
    if start.tzinfo is None:
        start = start.replace(tzinfo=dt.UTC)
    if end.tzinfo is None:
        end = end.replace(tzinfo=dt.UTC)
    seconds = max(0, int((end - start).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def gpus_cell(job: dict[str, Any]) -> str:
    """``2`` for a job of 2 GPUs; ``2@box:0,1`` while it holds GPUs 0 and 1 of host ``box``."""
    held = job.get("held_gpus") or []
    if not held:
        return str(job.get("gpus", 1))
    hosts: dict[str, list[str]] = {}
    for gpu in held:
        hosts.setdefault(gpu["worker"], []).append(str(gpu["device"] if gpu["device"] is not None else gpu["slot"]))
    return f"{job.get('gpus', len(held))}@" + ";".join(f"{host}:{','.join(ids)}" for host, ids in hosts.items())


def run_show(args: argparse.Namespace) -> int:
    from cli.show import show  # cli.show builds on this module's cells

    with connect() as client:
        print(show(client, args.job_id, raw=args.json))
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    with connect() as client:
        job = call(client, "POST", f"/v1/jobs/{args.job_id}/cancel").json()
    print(f"{job['id']}: {job['status']}" + (" (stopping: checkpoint, then exit)" if job["status"] == "running" else ""))
    return 0


def run_logs(args: argparse.Namespace) -> int:
    with connect() as client:
        if args.follow:
            return follow(client, args.job_id, sys.stdout)
        job = call(client, "GET", f"/v1/jobs/{args.job_id}").json()
        if job["status"] in FINISHED:
            return follow(client, args.job_id, sys.stdout)
        # A live job's stream never ends by itself: print what is there and stop.
        with client.stream("GET", f"/v1/jobs/{args.job_id}/events", timeout=httpx.Timeout(30, read=2)) as response:
            check(response)
            try:
                for _, kind, data in sse_events(response):
                    print(describe(kind, data))
            except httpx.ReadTimeout:
                pass
    return 0


def follow(client: httpx.Client, job_id: str, out: TextIO) -> int:
    """Stream a job's events until it ends, with a progress line; exit 0 only if it succeeded.

    On a terminal the steps redraw one progress line on stderr; anywhere else (CI logs, ``| tee``,
    a finished job's ``ftq logs``) each step is a line of its own on ``out``, so nothing is lost.
    A dropped connection is resumed with ``Last-Event-ID``, so no event is missed or repeated.
    """
    last_id: int | None = None
    status = None
    progress = sys.stderr.isatty() and out is sys.stdout
    while status is None:
        headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
        try:
            with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
                check(response)
                for seq, kind, data in sse_events(response):
                    last_id = seq
                    if kind == "step" and progress:
                        sys.stderr.write("\r" + progress_line(data))
                        sys.stderr.flush()
                        continue
                    if progress:
                        sys.stderr.write("\r\033[K")
                    print(describe(kind, data), file=out, flush=True)
                    if kind == "state" and data.get("status") in FINISHED:
                        status = data["status"]
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
            time.sleep(1)  # the server went away mid-stream: resume after the last event seen
    return 0 if status == "succeeded" else 1


def progress_line(step: dict[str, Any]) -> str:
    total = step.get("total_steps")
    done = step["step"]
    bar = ""
    if total:
        filled = int(30 * done / total)
        bar = "[" + "#" * filled + "-" * (30 - filled) + "] "
    loss = step.get("loss")
    rate = step.get("tokens_per_s")
    margin, accuracy = step.get("reward_margin"), step.get("reward_accuracy")  # DPO steps only
    return (f"{bar}step {done}/{total or '?'}"
            + (f"  loss {loss:.4f}" if loss is not None else "")
            + (f"  margin {margin:.3f} acc {accuracy:.2f}" if margin is not None and accuracy is not None else "")
            + (f"  {rate:,.0f} tok/s" if rate is not None else ""))


def describe(kind: str, data: dict[str, Any]) -> str:
    """One line per event for people."""
    if kind == "state":
        extra = data.get("error_code") or data.get("reason") or data.get("message")
        if data.get("status") == "failed" and data.get("error_code") and data.get("message"):
            extra = f"{data['error_code']}: {str(data['message']).splitlines()[0]}"
        if data.get("slots") and not extra:
            slots = data["slots"]
            extra = f"on {data.get('worker_id')}, GPU slot{'s' if len(slots) > 1 else ''} {','.join(map(str, slots))}"
        return f"state: {data.get('status')}" + (f" ({extra})" if extra else "")
    if kind == "step":
        return progress_line(data)
    if kind == "log":
        return f"{data.get('level', 'info')}: {data.get('message')}"
    if kind == "checkpoint":
        return f"checkpoint: step {data.get('step')}{' (final)' if data.get('final') else ''}"
    if kind == "plan":
        # attention and loss always pick a backend; the other decisions are optimizations, on or off.
        on = [d["name"] for d in data.get("decisions", []) if d.get("enabled") and d["name"] not in ("attention", "loss")]
        on = [name for name in on if name != "parallelism"]
        device = (data.get("hardware") or {}).get("device")
        ranks = ""
        if (data.get("world_size") or 1) > 1:
            how = {d["name"]: d.get("backend") for d in data.get("decisions", [])}.get("parallelism")
            link = (data.get("hardware") or {}).get("interconnect")
            ranks = f", {data['world_size']} ranks" + (f" ({', '.join(x for x in (how, link) if x)})" if how or link else "")
        return (f"plan: {device}{ranks}, {data.get('total_steps')} steps, "
                f"optimizations on: {', '.join(on) or 'none'}")
    if kind == "eval":
        loss = data.get("loss")
        return f"eval: step {data.get('step')} loss " + (f"{loss:.4f}" if isinstance(loss, (int, float)) else str(loss))
    if kind == "sample":
        return sample_lines(data)
    if kind == "rollouts":
        return rollout_lines(data)
    if kind == "progress" and "prompts_done" in data:  # a generation job's (trainer.generate.job)
        rate = data.get("tokens_per_s")
        return (f"progress: {data['prompts_done']}/{data.get('prompts_total')} prompts"
                + (f", {rate:,.0f} tok/s" if rate is not None else ""))
    return f"{kind}: {json.dumps(data, ensure_ascii=False)}"


def sample_lines(data: dict[str, Any]) -> str:
    """A ``sample`` event as text: a head line, then ``prompt → completion`` per generation.

    The text is printed as the trainer decoded it: a U+FFFD (a token that ends inside a UTF-8
    character) shows as the replacement character it is; control characters other than newline
    and tab are escaped (``\\x1b``) so a generation cannot drive the terminal. A line break in a
    prompt or completion continues on an indented line.
    """
    lines = [f"sample: step {data.get('step')}" + (" (final)" if data.get("final") else "")]
    for sample in data.get("samples") or []:
        completion = _shown(sample.get("completion")) or "(nothing: end of sequence first)"
        tokens = sample.get("tokens")
        lines.append(f"  {_shown(sample.get('prompt'))} → {completion}"
                     + (f"  ({tokens} token{'s' if tokens != 1 else ''})" if tokens is not None else ""))
    return "\n".join(lines)


def rollout_lines(data: dict[str, Any]) -> str:
    """A GRPO step's ``rollouts`` event as text: a head line, then ``[reward] prompt → completion``
    per rollout (escaped as ``sample_lines`` escapes)."""
    lines = [f"rollouts: step {data.get('step')}"]
    for rollout in data.get("rollouts") or []:
        completion = _shown(rollout.get("completion")) or "(nothing: end of sequence first)"
        lines.append(f"  [reward {rollout.get('reward')}] {_shown(rollout.get('prompt'))} → {completion}")
    return "\n".join(lines)


def _shown(text: Any) -> str:
    text = "" if text is None else str(text)
    escaped = "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else ascii(c)[1:-1] for c in text)
    return escaped.replace("\n", "\n    ")


def run_download(args: argparse.Namespace) -> int:
    """The final adapter, or ``--step N``'s checkpoint; when neither is there, the error names the
    steps that are (``ftq download JOB --step N``) instead of a REST route."""
    if args.step is None:
        path, default = f"/v1/jobs/{args.job_id}/adapter", f"{args.job_id}-adapter.{args.format}"
    else:
        path, default = f"/v1/jobs/{args.job_id}/checkpoints/{args.step}/download", f"{args.job_id}-step-{args.step}.{args.format}"
    target = args.output or Path(default)
    with connect() as client:
        with client.stream("GET", path, params={"format": args.format}) as response:
            if not response.is_success:
                response.read()
                if response.status_code in (404, 409):
                    _explain_missing(client, args, response)
                check(response)
            with target.open("wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
    print(f"wrote {target} ({target.stat().st_size:,} bytes)")
    return 0


def _explain_missing(client: httpx.Client, args: argparse.Namespace, response: httpx.Response) -> None:
    """Raise a CliError that says which checkpoints the job has, for a 404/409 of a download."""
    job = client.get(f"/v1/jobs/{args.job_id}")
    if not job.is_success:
        return  # the job itself is missing: the API's own message says so
    status = job.json()["status"]
    steps = [c["step"] for c in call(client, "GET", f"/v1/jobs/{args.job_id}/checkpoints").json()["data"]]
    have = (f"its checkpoints are at step {', '.join(map(str, steps))}: `ftq download {args.job_id} --step {steps[-1]}`"
            if steps else "it has no checkpoint (set checkpoint_every to keep some)")
    if args.step is None:
        raise CliError(f"job {args.job_id} is {status}: the final adapter exists only once it has succeeded; {have}")
    raise CliError(f"job {args.job_id} has no checkpoint at step {args.step}; {have}")
