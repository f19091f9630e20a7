"""Evals a training job names (``JobSpec.evals``): checked when the job is submitted, run on its
base and on its tuned model once it has succeeded, and compared.

    submission   ``check_job_evals``: each eval as a run of the base would be checked (the eval
                 readable by the owner, the items against its schema, the templates), nothing stored
    success      ``start_runs`` (the worker, after it records ``succeeded``): two runs per eval, one
                 on the base (``job.model``) and one on ``job:<id>``, their metadata ``ftq_job`` (the
                 training job) and ``ftq_side`` (``base`` or ``tuned``), and one per checkpoint the eval
                 names (``job:<id>@<step>``, ``ftq_side`` ``checkpoint``, ``ftq_step``;
                 ``core.evals.checkpoints``); a run that cannot start is a warning in the training
                 job's log, never a change of its status
    read         ``compare``: per eval, each side's run and results, each criterion's pass rate on
                 both and the difference, the checkpoints' scores by step, and the items side by side
                 (``changed``: their statuses differ)
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.errors import FtqError, InvalidInput
from core.evals import checkpoints, runs, views
from core.evals.models import EvalRun
from core.jobs.models import Job
from core.jobs.service import append_events
from core.jobs.spec import JobSpec
from core.settings import Settings
from core.users.service import Caller, caller_of, user_by_id

SIDES = ("base", "tuned")
CHECKPOINT = "checkpoint"
"""``ftq_side`` of a run on one of the job's checkpoints (``ftq_step`` says which)."""


def check_job_evals(session: Session, owner: Caller, spec: JobSpec, *, settings: Settings) -> None:
    """Each of ``spec.evals`` as a run on the base, and the checkpoints it names
    (``core.evals.checkpoints.check``); ``InvalidInput`` naming ``evals[i]...`` otherwise."""
    checkpoints.check(spec)
    for i, job_eval in enumerate(spec.evals):
        body = {"data_source": {**job_eval.data_source, "model": spec.model}}
        try:
            runs.check(session, owner, job_eval.eval_id, body, settings=settings)
        except FtqError as exc:
            param = f"evals[{i}].{exc.param or 'eval_id'}".replace(".data_source.data_source", ".data_source")
            raise InvalidInput(f"evals[{i}]: {exc}", param=param) from None


def start_runs(sessions: sessionmaker[Session], job_id: str, *, settings: Settings, record: Any) -> list[str]:
    """The succeeded job's eval runs, base, tuned and the checkpoints each eval names, queued;
    returns their jobs' ids (to wake). ``record(session, spec, owner, attach) -> Job``:
    ``core.jobs.submit.record`` with an ``Origin(attach=attach)`` (passed in: the submission path
    imports this module)."""
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None or job.kind != "train" or not job.spec.get("evals") or job.owner_id is None:
            return []
        spec = JobSpec.model_validate(job.spec)
        owner = caller_of(session, user_by_id(session, job.owner_id))
        targets = []
        for job_eval in spec.evals:
            targets += [(job_eval, side, model, {}) for side, model in zip(SIDES, (spec.model, f"job:{job_id}"))]
            chosen = checkpoints.steps(session, job_id, job_eval)
            targets += [(job_eval, CHECKPOINT, f"job:{job_id}@{step}", {"ftq_step": str(step)}) for step in chosen.run]
            if chosen.missing:
                _warn(session, job_id, f"eval {job_eval.eval_id}: the job wrote no checkpoint at step(s) "
                      f"{', '.join(map(str, chosen.missing))}; those runs were not started")
    started = []
    for job_eval, side, model, extra in targets:
        label = f"step {extra['ftq_step']}" if extra else side
        body = {"name": f"{label}: {job.name or job_id}", "metadata": {"ftq_job": job_id, "ftq_side": side, **extra},
                "data_source": {**job_eval.data_source, "model": model}}
        with sessions() as session:
            run_job_id = _start_one(session, owner, job_eval.eval_id, body, settings=settings, record=record)
            if isinstance(run_job_id, FtqError):
                _warn(session, job_id, f"eval {job_eval.eval_id} on the {label} model did not start: {run_job_id}")
            else:
                started.append(run_job_id)
    return started


def _start_one(session: Session, owner: Caller, eval_id: str, body: dict[str, Any], *, settings: Settings,
               record: Any) -> str | FtqError:
    """One run queued: its job's id, or the error that refused it (nothing of it stored)."""
    try:
        prepared = runs.prepare(session, owner, eval_id, body, settings=settings)
    except FtqError as exc:
        return exc
    try:
        run_job = record(session, prepared.spec, owner, runs.attach_run(prepared, owner))
        session.commit()
        return str(run_job.job_id)
    except FtqError as exc:
        session.rollback()
        runs.discard(session, prepared)
        return exc


def _warn(session: Session, job_id: str, message: str) -> None:
    append_events(session, job_id, [("log", {"level": "warning", "message": message})])
    session.commit()


def compare(session: Session, job: Job, settings: Settings, *, items: bool = True) -> list[dict[str, Any]]:
    """Per eval the job names: its base and tuned runs (OpenAI's run objects, None before they
    exist), each criterion's pass rate and mean score on both and the difference, the checkpoint
    runs in step order (``checkpoints``: step, run, each criterion's pass rate and mean score),
    and (``items``) the items side by side."""
    out = []
    for job_eval in job.spec.get("evals") or []:
        sides, steps = _runs(session, job.job_id, job_eval["eval_id"])
        objects, lines = {}, {}
        for side, (run, run_job) in sides.items():
            lines[side] = views.graded_lines(run_job, settings)
            criteria = run_job.spec["testing_criteria"]
            objects[side] = views.run_object(run, run_job, criteria, settings, lines=lines[side])
        entry = {"eval_id": job_eval["eval_id"], "base": objects.get("base"), "tuned": objects.get("tuned"),
                 "criteria": _criteria(objects),
                 "checkpoints": [_checkpoint(step, *steps[step], settings) for step in sorted(steps)]}
        if items:
            entry["items"] = _items(lines)
        out.append(entry)
    return out


def _runs(session: Session, job_id: str, eval_id: str) -> tuple[dict[str, tuple[EvalRun, Job]],
                                                                 dict[int, tuple[EvalRun, Job]]]:
    """The job's newest run of each side, and of each checkpoint step."""
    found: dict[str, tuple[EvalRun, Job]] = {}
    steps: dict[int, tuple[EvalRun, Job]] = {}
    rows = session.execute(select(EvalRun, Job).join(Job, Job.job_id == EvalRun.job_id).where(
        EvalRun.eval_id == eval_id).order_by(EvalRun.created_at))
    for run, run_job in rows:
        meta = run.user_metadata or {}
        if meta.get("ftq_job") != job_id:
            continue
        if meta.get("ftq_side") in SIDES:
            found[meta["ftq_side"]] = (run, run_job)  # the newest of each side
        elif meta.get("ftq_side") == CHECKPOINT and str(meta.get("ftq_step", "")).isdigit():
            steps[int(meta["ftq_step"])] = (run, run_job)
    return found, steps


def _checkpoint(step: int, run: EvalRun, run_job: Job, settings: Settings) -> dict[str, Any]:
    obj = views.run_object(run, run_job, run_job.spec["testing_criteria"], settings)
    return {"step": step, "run": obj, "criteria": [
        {"name": r["testing_criteria"], "pass_rate": r["pass_rate"], "mean_score": r["mean_score"]}
        for r in obj["per_testing_criteria_results"]]}


def _criteria(objects: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rates: dict[str, dict[str, Any]] = {}
    for side, run in objects.items():
        for result in run["per_testing_criteria_results"]:
            row = rates.setdefault(result["testing_criteria"], {"name": result["testing_criteria"]})
            row[side], row[f"{side}_mean_score"] = result["pass_rate"], result["mean_score"]
    for row in rates.values():
        base, tuned = row.get("base"), row.get("tuned")
        row["difference"] = tuned - base if base is not None and tuned is not None else None
        base, tuned = row.get("base_mean_score"), row.get("tuned_mean_score")
        row["mean_score_difference"] = tuned - base if base is not None and tuned is not None else None
    return list(rates.values())


def _items(lines: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    by_index: dict[int, dict[str, Any]] = {}
    for side, side_lines in lines.items():
        for line in side_lines:
            row = by_index.setdefault(line["index"], {"index": line["index"], "item": line.get("item"),
                                                      "input": line.get("messages")})
            text = line["choices"][0]["text"] if line.get("choices") else ""
            row[side] = {"output": text, "status": line["status"],
                         "scores": {r["name"]: r["score"] for r in line["results"]}}
    for row in by_index.values():
        row["changed"] = ("base" in row and "tuned" in row and row["base"]["status"] != row["tuned"]["status"])
    return [by_index[i] for i in sorted(by_index)]


def summary(session: Session, job: Job, settings: Settings) -> list[dict[str, Any]] | None:
    """``compare`` without the items, each run as its id, status and counts: what the OpenAI
    fine-tuning job object carries as ``evals`` (None for a job that names no evals)."""
    if not job.spec.get("evals"):
        return None

    def brief(run: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if run is None else {"run_id": run["id"], "model": run["model"], "status": run["status"],
                                         "result_counts": run["result_counts"]}

    return [{"eval_id": entry["eval_id"], "base": brief(entry["base"]), "tuned": brief(entry["tuned"]),
             "criteria": entry["criteria"],
             "checkpoints": [{"step": c["step"], **(brief(c["run"]) or {}), "criteria": c["criteria"]}
                             for c in entry["checkpoints"]]}
            for entry in compare(session, job, settings, items=False)]
