"""``ftq show JOB``: one job for people; ``--json`` prints the API's object as it is.

The summary reads ``GET /v1/jobs/{id}`` (state, plan, summary of losses, error), the last steps
of ``/metrics`` (epoch, tokens/s), ``/checkpoints`` and, once the job succeeded, ``/exports``,
and ends with the commands that take the job further: download, export, resume, rerun.

    job-0f3a…  "lr 1e-4"  failed
      model        tiny (lora), 1 GPU, owner admin, priority normal
      time         created 2026-01-02 10:00 UTC, ran 3m05s, attempt 1
      progress     step 30/40 (75%), epoch 1.50
      train loss   last 1.2345, best 1.1000
      ...
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from cli.client import call
from cli.jobs import duration_cell, gpus_cell, queue_line
from trainer.catalog import EXPORT_FORMATS

SPEED_STEPS = 10
"""Steps averaged for tokens/s and MFU (one step's rate jitters with its sequence lengths)."""
LABEL = 13


def show(client: httpx.Client, job_id: str, *, raw: bool = False) -> str:
    """The job as the summary (or, ``raw``, as the API's JSON)."""
    job = call(client, "GET", f"/v1/jobs/{job_id}").json()
    if raw:
        return json.dumps(job, indent=2, ensure_ascii=False)
    steps: list[dict[str, Any]] = []
    if job["progress"]["step"] > 0:
        params = {"after_step": max(-1, job["progress"]["step"] - SPEED_STEPS - 1), "limit": SPEED_STEPS}
        steps = call(client, "GET", f"/v1/jobs/{job_id}/metrics", params=params).json()["data"]
    checkpoints = call(client, "GET", f"/v1/jobs/{job_id}/checkpoints").json()["data"]
    exports = call(client, "GET", f"/v1/jobs/{job_id}/exports").json()["data"] if job["status"] == "succeeded" else []
    return format_job(job, steps, checkpoints, exports)


def format_job(job: dict[str, Any], steps: list[dict[str, Any]], checkpoints: list[dict[str, Any]],
               exports: list[dict[str, Any]]) -> str:
    """The summary of ``job`` given its last ``steps`` (metric rows), ``checkpoints`` and ``exports``."""
    if job.get("kind") in ("generate", "eval"):
        from cli.generate import format_generation_job

        return format_generation_job(job)
    name = f'  "{job["name"]}"' if job.get("name") else ""
    lines = [f"{job['id']}{name}  {job['status']}" + ("  (cancel requested)" if job.get("cancel_requested") else "")]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<{LABEL}}{text}")

    gpus = f"{job['gpus']} GPU{'s' if job['gpus'] != 1 else ''}"
    gpus += f" on {job['nodes']} machines" if job.get("nodes", 1) > 1 else ""
    row("model", f"{job['model']} ({job['method']}), {gpus}, owner {job.get('owner') or '-'}, "
                 f"priority {job['priority']}")
    row("time", _times(job))
    if job.get("queue"):
        row("queue", queue_line(job["queue"]))
    if job.get("held_gpus"):
        row("running on", gpus_cell(job).partition("@")[2])
    row("progress", _progress(job, steps))
    summary = job.get("summary") or {}
    row("train loss", f"last {_loss(summary.get('final_train_loss'))}, best {_loss(summary.get('best_train_loss'))}"
        + (f" ({summary['skipped_steps']} non-finite steps skipped)" if summary.get("skipped_steps") else ""))
    if job.get("validation_file"):
        at = f" at step {summary['best_eval_step']}" if summary.get("best_eval_step") is not None else ""
        row("eval loss", f"last {_loss(summary.get('final_eval_loss'))}, "
                         f"best {_loss(summary.get('best_eval_loss'))}{at}")
    if steps:
        row("speed", _speed(steps, summary))
    lines += _plan_lines(job.get("plan"))
    for warning in (job.get("preflight") or {}).get("warnings") or []:
        row("warning", warning)
    if job.get("error"):
        error = job["error"]
        row("error", f"{error['code']}: {error.get('message') or '(no message)'}")
        if error.get("detail"):
            row("", f"the rest (the trainer's stderr tail): ftq show {job['id']} --json, under error.detail")
    lines += [f"  {label:<{LABEL}}{text}" for label, text in next_commands(job, checkpoints, exports)]
    return "\n".join(lines)


def _times(job: dict[str, Any]) -> str:
    text = f"created {_when(job['created_at'])}"
    if job.get("started_at"):
        text += f", {'ran' if job.get('finished_at') else 'running for'} {duration_cell(job)}"
    if job.get("finished_at"):
        text += f", finished {_when(job['finished_at'])}"
    return text + (f", attempt {job['attempts']}" if job.get("attempts", 0) > 1 else "")


def _when(stamp: str) -> str:
    return stamp[:16].replace("T", " ") + " UTC"


def _progress(job: dict[str, Any], steps: list[dict[str, Any]]) -> str:
    step, total = job["progress"]["step"], job["progress"]["total_steps"]
    text = f"step {step}/{total or '?'}" + (f" ({100 * step / total:.0f}%)" if total else "")
    epoch = steps[-1].get("epoch") if steps else None
    return text + (f", epoch {epoch:.2f}" if epoch is not None else "")


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _speed(steps: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    rates = [s["tokens_per_s"] for s in steps if s.get("tokens_per_s") is not None]
    mfus = [s["mfu"] for s in steps if s.get("mfu") is not None]
    parts = [f"{sum(rates) / len(rates):,.0f} tokens/s" if rates else "tokens/s -"]
    if mfus:
        parts.append(f"MFU {100 * sum(mfus) / len(mfus):.1f}%")
    text = ", ".join(parts) + f" (mean of the last {len(steps)} step{'s' if len(steps) != 1 else ''})"
    last = steps[-1]
    if last.get("reward_margin") is not None and last.get("reward_accuracy") is not None:
        text += f"; DPO margin {last['reward_margin']:.3f}, accuracy {last['reward_accuracy']:.2f}"
    return text + (f"; {summary['trained_tokens']:,} tokens trained" if summary.get("trained_tokens") else "")


def _plan_lines(plan: dict[str, Any] | None) -> list[str]:
    """``plan  cuda (NVIDIA H100), bfloat16, 1 rank``, then one line per decision: on/off, name, backend, why."""
    if not plan:
        return [f"  {'plan':<{LABEL}}not yet (the trainer reports it when it starts)"]
    hardware = plan.get("hardware") or {}
    where = plan["device"] + (f" ({hardware['name']})" if hardware.get("name") else "")
    ranks = plan.get("world_size") or 1
    lines = [f"  {'plan':<{LABEL}}{where}, {plan['dtype']}, {ranks} rank{'s' if ranks != 1 else ''}"
             + (f", resumed from step {plan['resumed_from_step']}" if plan.get("resumed_from_step") else "")]
    decisions = plan.get("decisions") or []
    width = max((len(d["name"]) for d in decisions), default=0)
    for d in decisions:
        backend = f" [{d['backend']}]" if d.get("backend") else ""
        lines.append(f"    {'on ' if d['enabled'] else 'off'}  {d['name']:<{width}}  {d['reason']}{backend}")
    return lines


def next_commands(job: dict[str, Any], checkpoints: list[dict[str, Any]],
                  exports: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(label, command)`` rows: where to download the job's results and what else to run on it."""
    job_id, status = job["id"], job["status"]
    rows = []
    if status == "succeeded":
        what = "the fine-tuned model" if job["method"] == "full" else "the adapter"
        rows.append(("download", f"ftq download {job_id}  ({what}, zip; --format tar.gz)"))
        rows.append(("export", f"ftq export {job_id} --format {'|'.join(EXPORT_FORMATS)}"))
        if exports:
            kinds = ", ".join(f"{e['format']}{'/' + e['quantization'] if e.get('quantization') else ''} {e['status']}"
                              for e in exports)
            rows.append(("exports", f"{kinds}: ftq exports {job_id}"))
    steps = [c["step"] for c in checkpoints]
    if steps:
        listed = ", ".join(f"{c['step']}{' (final)' if c.get('final') else ''}" for c in checkpoints)
        rows.append(("checkpoints", f"step {listed}: ftq download {job_id} --step {steps[-1]}"))
        if status in ("failed", "cancelled"):
            rows.append(("resume", f"ftq resume {job_id}  (from step {steps[-1]}; --step N for another)"))
    if status in ("queued", "running"):
        rows.append(("cancel", f"ftq cancel {job_id}"))
    rows += [("logs", f"ftq logs {job_id}  (events and samples); ftq metrics {job_id}  (steps as CSV)"),
             ("rerun", f"ftq rerun {job_id} --set KEY=VALUE  (a copy with changes)"),
             ("raw", f"ftq show {job_id} --json")]
    return rows
