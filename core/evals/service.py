"""Evals: create, read, list, update, delete; scoped like files and jobs (``core.users.access``).

An eval is a ``custom`` data source config (the JSON schema every run's items must match) and
its testing criteria: OpenAI's graders (``trainer.graders``), each checked at creation, the
first bad field named (``testing_criteria[1].source``: a python grader that does not compile),
with the eval's ``pass_threshold`` kept beside it. A ``score_model`` or ``label_model`` grader's
``model`` (also inside a ``multi``) is its judge, a model on this box resolved as a run's model is
(``check_judges``): one the eval's project may not name is refused as a run's model is, naming
``testing_criteria[i].model``. Nothing is stored when a check fails.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db import utcnow
from core.errors import Conflict, InvalidInput, ModelNotFound, NotFound
from core.evals.items import check_schema
from core.evals.models import Eval, EvalRun
from core.jobs.generation import resolve_judge
from core.jobs.models import Job
from core.jobs.states import ACTIVE_STATUSES
from core.openai.catalog import get_model
from core.settings import Settings
from core.users import access
from core.users.service import Caller
from trainer.graders import GraderError, model_graders, validate

MAX_CRITERIA = 32
MAX_METADATA = 16


def new_eval_id(prefix: str = "eval") -> str:
    """OpenAI-style ids: ``eval_<32 hex>``, ``evalrun_<32 hex>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def check_metadata(metadata: Any, param: str = "metadata") -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        raise InvalidInput(f"{param}: an object of at most {MAX_METADATA} string pairs", param=param)
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise InvalidInput(f"{param}.{key}: keys are at most 64 characters, values strings of at most 512",
                               param=f"{param}.{key}")
    return metadata


def check_data_source_config(config: Any) -> tuple[dict[str, Any], bool]:
    """``(item_schema, include_sample_schema)`` of a ``custom`` data source config."""
    if not isinstance(config, dict) or config.get("type") != "custom":
        got = config.get("type") if isinstance(config, dict) else config
        raise InvalidInput(f"data_source_config.type: ftq takes 'custom' (an item_schema; runs bring their items), "
                           f"got {got!r}: there are no stored completions or logs on this box",
                           param="data_source_config.type")
    unknown = sorted(set(config) - {"type", "item_schema", "include_sample_schema"})
    if unknown:
        raise InvalidInput(f"data_source_config.{unknown[0]}: unknown field", param=f"data_source_config.{unknown[0]}")
    if "item_schema" not in config:
        raise InvalidInput("data_source_config.item_schema: missing", param="data_source_config.item_schema")
    sample = config.get("include_sample_schema", False)
    if not isinstance(sample, bool):
        raise InvalidInput("data_source_config.include_sample_schema: must be true or false",
                           param="data_source_config.include_sample_schema")
    return check_schema(config["item_schema"], "data_source_config.item_schema"), sample


def check_criteria(criteria: Any) -> list[dict[str, Any]]:
    """The testing criteria validated (``trainer.graders.validate``), names unique, each with its
    ``pass_threshold``; a model grader's judge is ``check_judges``'."""
    if not isinstance(criteria, list) or not criteria or len(criteria) > MAX_CRITERIA:
        raise InvalidInput(f"testing_criteria: a list of 1 to {MAX_CRITERIA} graders", param="testing_criteria")
    checked, names = [], set()
    for i, raw in enumerate(criteria):
        param = f"testing_criteria[{i}]"
        if not isinstance(raw, dict):
            raise InvalidInput(f"{param}: must be a grader object with a 'type'", param=param)
        grader = {k: v for k, v in raw.items() if k != "pass_threshold"}
        try:
            criterion = validate(grader, param)
        except GraderError as exc:
            raise InvalidInput(exc.message, param=exc.param) from None
        if criterion["name"] in names:
            raise InvalidInput(f"{param}.name: {criterion['name']!r} names another criterion too; results are "
                               "reported by name", param=f"{param}.name")
        names.add(criterion["name"])
        threshold = raw.get("pass_threshold")
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
                raise InvalidInput(f"{param}.pass_threshold: must be a number", param=f"{param}.pass_threshold")
            criterion["pass_threshold"] = float(threshold)
        checked.append(criterion)
    return checked


def check_judges(session: Session, caller: Caller, criteria: list[dict[str, Any]], *, settings: Settings,
                 project_id: str | None) -> None:
    """Each model grader's ``model`` names a judge ``caller`` may use in ``project_id``: a base, or
    ``job:<id>[@<step>]``, ``export:<id>``, an ``ft:`` name of the project (``core.jobs.generation.resolve``,
    as a run's model). Raises ``InvalidInput`` (``ModelNotFound`` for an ``ft:`` name, as a run's)
    naming ``testing_criteria[i].model`` or ``testing_criteria[i].graders.<key>.model``."""
    for i, criterion in enumerate(criteria):
        for param, grader in model_graders(criterion, f"testing_criteria[{i}]"):
            if grader["model"].startswith("ft:"):
                try:
                    get_model(session, caller, grader["model"], settings.model_root)
                except ModelNotFound as exc:
                    raise ModelNotFound(exc.message, param=f"{param}.model") from None
            resolve_judge(session, grader["model"], param, settings=settings, project_id=project_id, check_hub=True)


def create_eval(session: Session, caller: Caller, *, data_source_config: Any, testing_criteria: Any,
                settings: Settings, name: str | None = None, metadata: Any = None, project: str | None = None) -> Eval:
    """Check and store an eval in the caller's project (``project``: a project name); commits."""
    item_schema, sample = check_data_source_config(data_source_config)
    criteria = check_criteria(testing_criteria)
    metadata = check_metadata(metadata)
    if name is not None and (not isinstance(name, str) or len(name) > 200):
        raise InvalidInput("name: a string of at most 200 characters", param="name")
    project_id = access.project_for_create(session, caller, project)
    check_judges(session, caller, criteria, settings=settings, project_id=project_id)
    now = utcnow()
    row = Eval(eval_id=new_eval_id(), name=name or "eval", user_metadata=metadata, item_schema=item_schema,
               include_sample_schema=sample, testing_criteria=criteria, owner_id=caller.user_id,
               project_id=project_id, created_at=now, updated_at=now)
    session.add(row)
    session.commit()
    return row


def get_eval(session: Session, eval_id: str, *, reader: Caller) -> Eval:
    """The eval, if ``reader`` may read it; another project's (another user's on ``/openai/v1``) is unknown."""
    row = session.get(Eval, eval_id, populate_existing=True)
    if row is None or not reader.may_read(row.project_id, row.owner_id):
        raise NotFound(f"No such eval: {eval_id!r}; list evals with GET /v1/evals", param="eval_id")
    return row


def list_evals(session: Session, caller: Caller, *, order: str = "asc", order_by: str = "created_at",
               after: str | None = None, limit: int = 20) -> tuple[list[Eval], bool]:
    """A page of the evals ``caller`` reads (OpenAI's ``evals.list``: ``after`` an eval id)."""
    if order_by not in ("created_at", "updated_at"):
        raise InvalidInput("order_by: created_at or updated_at", param="order_by")
    column = Eval.created_at if order_by == "created_at" else Eval.updated_at
    rows = list(session.scalars(select(Eval).where(access.readable_by(caller, Eval)).order_by(column, Eval.eval_id)))
    return page(rows, lambda row: row.eval_id, order=order, after=after, limit=limit, what="eval")


def page(rows: list[Any], id_of: Any, *, order: str, after: str | None, limit: int,
         what: str) -> tuple[list[Any], bool]:
    """One page of ``rows`` (oldest first) in ``order``, after the row whose id is ``after``."""
    if order not in ("asc", "desc"):
        raise InvalidInput("order: asc or desc", param="order")
    if limit < 1:
        raise InvalidInput(f"limit: must be at least 1, got {limit}", param="limit")
    rows = rows if order == "asc" else rows[::-1]
    if after is not None:
        ids = [id_of(row) for row in rows]
        if after not in ids:
            raise InvalidInput(f"after: no {what} {after!r}; pass the id of the last {what} of the previous page",
                               param="after")
        rows = rows[ids.index(after) + 1:]
    limit = min(limit, 100)
    return rows[:limit], len(rows) > limit


def update_eval(session: Session, eval_id: str, caller: Caller, *, name: Any = None, metadata: Any = None) -> Eval:
    """Rename an eval or replace its metadata (its owner or an admin); commits."""
    row = get_eval(session, eval_id, reader=caller)
    access.require_owner(session, caller, row.owner_id, what=f"eval {eval_id}", action="update", param="eval_id",
                         project_id=row.project_id)
    if name is not None:
        if not isinstance(name, str) or not name or len(name) > 200:
            raise InvalidInput("name: a string of 1 to 200 characters", param="name")
        row.name = name
    if metadata is not None:
        row.user_metadata = check_metadata(metadata)
    row.updated_at = utcnow()
    session.commit()
    return row


def delete_eval(session: Session, eval_id: str, caller: Caller) -> None:
    """Delete an eval and its runs' rows (their jobs stay, as jobs); refused while a run is active."""
    row = get_eval(session, eval_id, reader=caller)
    access.require_owner(session, caller, row.owner_id, what=f"eval {eval_id}", action="delete", param="eval_id",
                         project_id=row.project_id)
    active = session.scalar(select(EvalRun.run_id).join(Job, Job.job_id == EvalRun.job_id).where(
        EvalRun.eval_id == eval_id, Job.status.in_([s.value for s in ACTIVE_STATUSES])).limit(1))
    if active is not None:
        raise Conflict(f"eval {eval_id} has a queued or running run ({active}); cancel it first", param="eval_id")
    for run in session.scalars(select(EvalRun).where(EvalRun.eval_id == eval_id)):
        session.delete(run)
    session.delete(row)
    session.commit()
