"""``/evals``: evals, their runs and the runs' output items, as the ``openai`` client's
``client.evals`` sends and parses them; mounted at ``/v1/evals`` (native errors) and
``/openai/v1/evals`` (OpenAI's error shape; per-owner reads as the rest of that API).

A run is a queued job of kind ``eval`` (``core.evals.runs``): created through the one submission
path (``core.jobs.submit``: access, the model and prompts checked, placement, the queue), its row
written in the job's transaction; a refused submission removes the run's prompts file again.
"""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Body, Query
from sqlalchemy.orm import Session

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.jobs.submit import ApiPorts
from core.errors import InvalidInput
from core.evals import after_training, runs, service, views
from core.jobs.models import Job
from core.jobs.service import get_job
from core.jobs.submit import Origin, submit

router = APIRouter(prefix="/evals", tags=["evals"])
jobs_router = APIRouter(prefix="/v1/jobs", tags=["evals"])
_RUN_PARAMS = {"model": "data_source.model", "prompts_file": "data_source.source",
               "sampling.max_tokens": "data_source.sampling_params.max_completion_tokens"}
"""A refused job's fields as the run's request names them."""
JsonBody = Annotated[dict[str, Any], Body()]


def _page(items: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": more, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None}


@router.post("", summary="evals.create: an item schema and testing criteria (graders)")
def create_eval(body: JsonBody, session: SessionDep, caller: CallerDep, state: StateDep) -> dict[str, Any]:
    unknown = sorted(set(body) - {"data_source_config", "testing_criteria", "name", "metadata", "project"})
    if unknown:
        raise InvalidInput(f"{unknown[0]}: unknown field", param=unknown[0])
    row = service.create_eval(session, caller, data_source_config=body.get("data_source_config"),
                              testing_criteria=body.get("testing_criteria"), settings=state.settings,
                              name=body.get("name"), metadata=body.get("metadata"), project=body.get("project"))
    return views.eval_object(row)


@router.get("", summary="evals.list")
def list_evals(session: SessionDep, caller: CallerDep, after: str | None = None, limit: Annotated[int, Query()] = 20,
               order: str = "asc", order_by: str = "created_at") -> dict[str, Any]:
    rows, more = service.list_evals(session, caller, order=order, order_by=order_by, after=after, limit=limit)
    return _page([views.eval_object(row) for row in rows], more)


@router.get("/{eval_id}", summary="evals.retrieve")
def retrieve_eval(eval_id: str, session: SessionDep, caller: CallerDep) -> dict[str, Any]:
    return views.eval_object(service.get_eval(session, eval_id, reader=caller))


@router.post("/{eval_id}", summary="evals.update: name, metadata")
def update_eval(eval_id: str, body: JsonBody, session: SessionDep, caller: CallerDep) -> dict[str, Any]:
    row = service.update_eval(session, eval_id, caller, name=body.get("name"), metadata=body.get("metadata"))
    return views.eval_object(row)


@router.delete("/{eval_id}", summary="evals.delete (its runs' rows too; refused while one runs)")
def delete_eval(eval_id: str, session: SessionDep, caller: CallerDep) -> dict[str, Any]:
    service.delete_eval(session, eval_id, caller)
    return {"object": "eval.deleted", "deleted": True, "eval_id": eval_id}


@router.post("/{eval_id}/runs", summary="evals.runs.create: a model answers each item, the criteria grade it")
async def create_run(eval_id: str, body: JsonBody, state: StateDep, caller: CallerDep) -> dict[str, Any]:
    def prepare() -> runs.Prepared:
        with state.sessions() as session:
            return runs.prepare(session, caller, eval_id, body, settings=state.settings)

    prepared = await to_thread.run_sync(prepare)

    def view(session: Session, job: Job) -> dict[str, Any]:
        run, job = runs.get_run(session, eval_id, prepared.run_id, reader=caller)
        return views.run_object(run, job, prepared.spec.testing_criteria, state.settings, lines=[])

    try:
        out, _ = await submit(ApiPorts(state), prepared.spec, caller, Origin(attach=runs.attach_run(prepared, caller)),
                              view=view)
    except InvalidInput as exc:
        await to_thread.run_sync(_discard, state, prepared)
        exc.param = _RUN_PARAMS.get(exc.param or "", exc.param)
        raise
    except BaseException:
        await to_thread.run_sync(_discard, state, prepared)
        raise
    return out


def _discard(state: Any, prepared: runs.Prepared) -> None:
    with state.sessions() as session:
        runs.discard(session, prepared)


@router.get("/{eval_id}/runs", summary="evals.runs.list")
def list_runs(eval_id: str, session: SessionDep, caller: CallerDep, state: StateDep, after: str | None = None,
              limit: Annotated[int, Query()] = 20, order: str = "asc", status: str | None = None) -> dict[str, Any]:
    pairs, more = runs.list_runs(session, eval_id, caller, order=order, status=status, after=after, limit=limit)
    return _page([views.run_object(run, job, job.spec["testing_criteria"], state.settings) for run, job in pairs],
                 more)


@router.get("/{eval_id}/runs/{run_id}", summary="evals.runs.retrieve: status and results so far")
def retrieve_run(eval_id: str, run_id: str, session: SessionDep, caller: CallerDep, state: StateDep) -> dict[str, Any]:
    run, job = runs.get_run(session, eval_id, run_id, reader=caller)
    return views.run_object(run, job, job.spec["testing_criteria"], state.settings)


@router.post("/{eval_id}/runs/{run_id}/cancel", summary="evals.runs.cancel")
def cancel_run(eval_id: str, run_id: str, session: SessionDep, caller: CallerDep, state: StateDep) -> dict[str, Any]:
    run, job = runs.cancel_run(session, eval_id, run_id, caller)
    return views.run_object(run, job, job.spec["testing_criteria"], state.settings)


@router.delete("/{eval_id}/runs/{run_id}", summary="evals.runs.delete (a finished run)")
def delete_run(eval_id: str, run_id: str, session: SessionDep, caller: CallerDep) -> dict[str, Any]:
    runs.delete_run(session, eval_id, run_id, caller)
    return {"object": "eval.run.deleted", "deleted": True, "run_id": run_id}


@router.get("/{eval_id}/runs/{run_id}/output_items", summary="evals.runs.output_items.list")
def list_output_items(eval_id: str, run_id: str, session: SessionDep, caller: CallerDep, state: StateDep,
                      after: str | None = None,
                      limit: Annotated[int, Query()] = 20, order: str = "asc",
                      status: str | None = None) -> dict[str, Any]:
    run, job = runs.get_run(session, eval_id, run_id, reader=caller)
    items, more = views.output_items(run, job, state.settings, status=status, order=order, after=after, limit=limit)
    return _page(items, more)


@router.get("/{eval_id}/runs/{run_id}/output_items/{output_item_id}", summary="evals.runs.output_items.retrieve")
def retrieve_output_item(eval_id: str, run_id: str, output_item_id: str, session: SessionDep,
                         caller: CallerDep, state: StateDep) -> dict[str, Any]:
    run, job = runs.get_run(session, eval_id, run_id, reader=caller)
    return views.one_output_item(run, job, output_item_id, state.settings)


@jobs_router.get("/{job_id}/evals", summary="A training job's evals: base vs tuned, per criterion and per item")
def job_evals(job_id: str, session: SessionDep, caller: CallerDep, state: StateDep) -> dict[str, Any]:
    """Per eval the job's spec names (``evals``): its runs on the base and on the tuned model (null
    until they exist: they start when the job succeeds), each criterion's pass rate on both and
    the difference, and the items side by side (``changed``: base and tuned statuses differ)."""
    return {"object": "list", "data": after_training.compare(session, get_job(session, job_id, reader=caller),
                                                                     state.settings)}
