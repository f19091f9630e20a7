"""Eval runs: a run's request checked and turned into a job of kind ``eval``; read, list, cancel, delete.

Creating a run (``prepare``, then the API submits the spec through ``core.jobs.submit`` with
``attach`` writing the run row in the job's transaction; ``discard`` if the submission is refused):

1. ``data_source``: ``type: completions`` (the model answers each item) or ``lm_eval`` (an
   lm-evaluation-harness task over the items: ``core.evals.lm_task``); its ``model`` a base,
   ``job:<id>``, ``job:<id>@<step>``, ``export:<id>`` or an ``ft:`` name (``core.openai.catalog``:
   one the caller may read, else 404 ``model_not_found``);
2. the items: ``source.type: file_id`` (a file uploaded with purpose ``evals``) or
   ``file_content`` (inline ``[{"item": {...}}]``), each matching the eval's item_schema, and
   each criterion's ``{{item.x}}`` present in each (the first bad line named); each model
   grader's judge still one the caller may name (``core.evals.service.check_judges``);
3. ``input_messages`` (``type: template``) rendered per item (a field an item lacks: its line);
4. the rendered prompts stored as a ``generate`` file (each line the messages and the item),
   the spec (``core.jobs.eval_spec.EvalJobSpec``) built on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db import new_id, utcnow
from core.errors import Conflict, InvalidInput, NotFound
from core.evals import items as eval_items
from core.evals import lm_task
from core.evals.models import Eval, EvalRun
from core.evals.service import check_judges, check_metadata, get_eval, new_eval_id, page
from core.evals.views import STATUSES
from core.files.models import File
from core.files.service import commit_file, get_file
from core.files.validate import validate_prompts
from core.jobs.eval_spec import EvalJobSpec
from core.jobs.generation import ft_reference
from core.jobs.models import Job
from core.jobs.service import cancel_job, get_job
from core.jobs.states import JobStatus
from core.openai.catalog import get_model
from core.projects.models import Project
from core.settings import Settings
from core.users import access
from core.users.service import Caller
from trainer.graders import GraderError
from trainer.graders.template import lookup

PURPOSE = "evals"
"""The files purpose of an eval's items file (OpenAI's)."""
_ITEM_TAG = re.compile(r"\{\{\s*(item\b[^}]*?)\s*\}\}")


@dataclass
class Prepared:
    """A checked run, its prompts file stored, its job not yet submitted."""

    run_id: str
    spec: EvalJobSpec
    prompts: File
    data_source: dict[str, Any]
    name: str
    metadata: dict[str, str] | None
    model: str
    """The model as the caller named it (the spec's may be its ``job:`` reference)."""


def prepare(session: Session, caller: Caller, eval_id: str, body: dict[str, Any], *, settings: Settings) -> Prepared:
    """Check a ``runs.create`` body against its eval and store the rendered prompts; commits the file only.

    Raises:
        NotFound: the eval, the file or an ``ft:`` model the caller may not read.
        InvalidInput: the first bad field or line (``InvalidDataset`` with ``line``).
    """
    ev, source, model, records = check(session, caller, eval_id, body, settings=settings)
    run_id = new_eval_id("evalrun")
    metadata = check_metadata(body.get("metadata"))
    name = body.get("name") or f"{source['model']} on {ev.name}"
    sampling, criteria, task = _sampling(source.get("sampling_params")), ev.testing_criteria, None
    if source["type"] == "lm_eval":
        task, criteria = lm_task.check_task(source["task"])
        sampling = lm_task.sampling(task)
    project = session.get(Project, ev.project_id) if ev.project_id else None
    spec = _spec(name=str(name)[:200], model=model, prompts_file=new_id("file"), sampling=sampling, eval_id=eval_id,
                 run_id=run_id, testing_criteria=criteria, lm_eval=task, project=project.name if project else None)
    prompts = _store_prompts(session, records, spec.prompts_file, run_id, caller, ev.project_id, settings)
    recorded = {**source, "model": source.get("model")}
    if recorded["source"].get("type") == "file_content":
        recorded["source"] = {"type": "file_content", "content": recorded["source"]["content"][:0],
                              "stored_as": prompts.file_id}
    return Prepared(run_id, spec, prompts, recorded, str(name)[:200], metadata, source["model"])


def check(session: Session, caller: Caller, eval_id: str, body: dict[str, Any], *,
          settings: Settings) -> tuple[Eval, dict[str, Any], str, list[dict[str, Any]]]:
    """Steps 1-3: ``(eval, data_source, the job's model, the prompts records)``; stores nothing."""
    ev = get_eval(session, eval_id, reader=caller)
    source = body.get("data_source")
    if not isinstance(source, dict) or source.get("type") not in ("completions", "lm_eval"):
        got = source.get("type") if isinstance(source, dict) else source
        raise InvalidInput(f"data_source.type: ftq runs 'completions' (a model on this box answers each item) or "
                           f"'lm_eval' (an lm-evaluation-harness task over the items), got {got!r}",
                           param="data_source.type")
    model = model_reference(session, caller, source.get("model"), settings=settings)
    items = load_items(session, caller, source.get("source"), settings=settings)
    param = _items_param(source["source"])
    eval_items.check_items(items, ev.item_schema, param)
    if source["type"] == "lm_eval":  # the task's templates render each item on the worker (trainer.evals.lm_run)
        lm_task.check_data_source(source)
        return ev, source, model, [{"prompt": json.dumps(item, ensure_ascii=False), "item": item} for item in items]
    check_criteria_fields(ev.testing_criteria, items, param)
    check_judges(session, caller, ev.testing_criteria, settings=settings, project_id=ev.project_id)
    template = _template(source.get("input_messages"))
    records = eval_items.render_prompts(template, items, template_param="data_source.input_messages.template",
                                        items_param=param)
    _sampling(source.get("sampling_params"))
    return ev, source, model, records


def attach_run(prepared: Prepared, caller: Caller) -> Any:
    """``core.jobs.submit.Origin.attach``: the run row, written in the job's transaction."""
    def attach(session: Session, job: Job) -> None:
        session.add(EvalRun(run_id=prepared.run_id, eval_id=prepared.spec.eval_id, job_id=job.job_id,
                            name=prepared.name, user_metadata=prepared.metadata, model=prepared.model,
                            data_source=prepared.data_source, owner_id=caller.user_id, project_id=job.project_id,
                            created_at=utcnow()))
    return attach


def discard(session: Session, prepared: Prepared) -> None:
    """Remove the prompts file of a run whose job was refused: nothing of it stays."""
    row = session.get(File, prepared.prompts.file_id)
    if row is not None:
        session.delete(row)
        session.commit()
    Path(prepared.prompts.path).unlink(missing_ok=True)


def model_reference(session: Session, caller: Caller, model: Any, *, settings: Settings) -> str:
    """The generation job's ``model`` for a run's: an ``ft:`` name becomes ``job:<id>[@step]``."""
    if not isinstance(model, str) or not model.strip():
        raise InvalidInput("data_source.model: name the model to evaluate (a base, job:<id>, an ft: name, "
                           "export:<id>)", param="data_source.model")
    if not model.startswith("ft:"):
        return model
    get_model(session, caller, model, settings.model_root)  # ModelNotFound (404) unless the caller reads it
    return ft_reference(model)


def _items_param(source: dict[str, Any]) -> str:
    return "data_source.source.content" if source.get("type") == "file_content" else "data_source.source.id"


def load_items(session: Session, caller: Caller, source: Any, *, settings: Settings) -> list[dict[str, Any]]:
    """The run's items from ``source``: an uploaded ``evals`` file or inline ``file_content``."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "file_content":
        content = source.get("content")
        if not isinstance(content, list) or not content:
            raise InvalidInput("data_source.source.content: a non-empty list of {\"item\": {...}}",
                               param="data_source.source.content")
        return [eval_items.item_of(record, i, "data_source.source.content") for i, record in enumerate(content, 1)]
    if kind == "file_id":
        try:
            row = get_file(session, str(source.get("id")), reader=caller)
        except NotFound:
            raise InvalidInput(f"data_source.source.id: no file {source.get('id')!r}; upload the items with "
                               "purpose='evals'", param="data_source.source.id") from None
        if row.purpose != PURPOSE or row.deleted_at is not None:
            raise InvalidInput(f"data_source.source.id: file {row.file_id} has purpose {row.purpose!r}; upload the "
                               "items with purpose='evals'", param="data_source.source.id")
        return eval_items.read_items(Path(row.path), "data_source.source.id")
    raise InvalidInput("data_source.source.type: file_id or file_content", param="data_source.source.type")


def check_criteria_fields(criteria: list[dict[str, Any]], items: list[dict[str, Any]], param: str) -> None:
    """Every ``{{item.x}}`` a criterion names is in every item (``sample`` comes at run time)."""
    tags = [(i, tag) for i, c in enumerate(criteria) for tag in _ITEM_TAG.findall(json.dumps(c))]
    for number, item in enumerate(items, start=1):
        for i, tag in tags:
            try:
                lookup(tag, {"item": item}, f"testing_criteria[{i}]")
            except GraderError as exc:
                raise InvalidInput(f"{param}: line {number}: {exc.message}", param=f"testing_criteria[{i}]") from None


def _template(input_messages: Any) -> list[dict[str, str]]:
    if not isinstance(input_messages, dict) or input_messages.get("type") != "template":
        raise InvalidInput("data_source.input_messages: {\"type\": \"template\", \"template\": [messages with "
                           "{{item.x}}]} (item_reference is not supported)", param="data_source.input_messages")
    return eval_items.check_template(input_messages.get("template"), "data_source.input_messages.template")


def _sampling(params: Any) -> dict[str, Any]:
    """OpenAI's ``sampling_params`` in the generation spec's words (its bounds apply)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidInput("data_source.sampling_params: an object", param="data_source.sampling_params")
    names = {"max_completion_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed"}
    unknown = sorted(set(params) - set(names) - {"reasoning_effort", "response_format", "tools"})
    if unknown:
        raise InvalidInput(f"data_source.sampling_params.{unknown[0]}: unknown field",
                           param=f"data_source.sampling_params.{unknown[0]}")
    out = {names[k]: v for k, v in params.items() if k in names and v is not None}
    if isinstance(out.get("temperature"), int):
        out["temperature"] = float(out["temperature"])
    if isinstance(out.get("top_p"), int):
        out["top_p"] = float(out["top_p"])
    return out


def _spec(**fields: Any) -> EvalJobSpec:
    """The job's spec; a sampling value out of its bounds is a 422 naming OpenAI's field."""
    names = {"max_tokens": "max_completion_tokens"}
    try:
        return EvalJobSpec.model_validate({"kind": "eval", **fields})
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"]]
        if loc and loc[0] == "sampling":
            loc = ["data_source", "sampling_params", *[names.get(part, part) for part in loc[1:]]]
        param = ".".join(loc)
        raise InvalidInput(f"{param}: {error['msg']}", param=param) from None


def _store_prompts(session: Session, records: list[dict[str, Any]], file_id: str, run_id: str, caller: Caller,
                   project_id: str | None, settings: Settings) -> File:
    path = settings.files_dir / f"{file_id}.jsonl"
    settings.files_dir.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    summary = validate_prompts(path)
    row = File(file_id=file_id, filename=f"{run_id}.prompts.jsonl", purpose="generate", bytes=len(data),
               sha256=hashlib.sha256(data).hexdigest(), format=summary.format, num_records=summary.num_records,
               path=str(path), stats=summary.stats, owner_id=caller.user_id, project_id=project_id,
               created_at=utcnow())
    return commit_file(session, row)


def get_run(session: Session, eval_id: str, run_id: str, *, reader: Caller) -> tuple[EvalRun, Job]:
    """The run and its job, if ``reader`` may read them."""
    get_eval(session, eval_id, reader=reader)
    run = session.get(EvalRun, run_id, populate_existing=True)
    if run is None or run.eval_id != eval_id or not reader.may_read(run.project_id, run.owner_id):
        raise NotFound(f"No such run: {run_id!r} of eval {eval_id}", param="run_id")
    return run, get_job(session, run.job_id)


def list_runs(session: Session, eval_id: str, caller: Caller, *, order: str = "asc", status: str | None = None,
              after: str | None = None, limit: int = 20) -> tuple[list[tuple[EvalRun, Job]], bool]:
    """A page of the eval's runs ``caller`` reads, with their jobs; ``status``: OpenAI's word."""
    get_eval(session, eval_id, reader=caller)
    if status is not None and status not in STATUSES.values():
        raise InvalidInput(f"status: one of {', '.join(STATUSES.values())}", param="status")
    rows = session.execute(select(EvalRun, Job).join(Job, Job.job_id == EvalRun.job_id).where(
        EvalRun.eval_id == eval_id, access.readable_by(caller, EvalRun)).order_by(EvalRun.created_at, EvalRun.run_id))
    pairs = [(run, job) for run, job in rows if status is None or STATUSES[job.status] == status]
    return page(pairs, lambda pair: pair[0].run_id, order=order, after=after, limit=limit, what="run")


def cancel_run(session: Session, eval_id: str, run_id: str, caller: Caller) -> tuple[EvalRun, Job]:
    """Cancel the run's job (its owner or an admin); commits. A finished run answers 409."""
    run, job = get_run(session, eval_id, run_id, reader=caller)
    access.require_owner(session, caller, run.owner_id, what=f"run {run_id}", action="cancel", param="run_id",
                         project_id=run.project_id)
    try:
        job, _ = cancel_job(session, job.job_id)
    except Conflict:
        raise Conflict(f"run {run_id} is already {STATUSES[job.status]}; only a queued or running run can be "
                       "canceled", param="run_id") from None
    session.commit()
    return run, get_job(session, job.job_id)


def delete_run(session: Session, eval_id: str, run_id: str, caller: Caller) -> None:
    """Delete a finished run's row (its job stays); a queued or running run answers 409."""
    run, job = get_run(session, eval_id, run_id, reader=caller)
    access.require_owner(session, caller, run.owner_id, what=f"run {run_id}", action="delete", param="run_id",
                         project_id=run.project_id)
    if job.status in (JobStatus.queued.value, JobStatus.running.value):
        raise Conflict(f"run {run_id} is {STATUSES[job.status]}; cancel it first", param="run_id")
    session.delete(run)
    session.commit()


def eval_of(session: Session, run: EvalRun) -> Eval:
    return session.get(Eval, run.eval_id)  # type: ignore[return-value]
