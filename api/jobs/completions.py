"""``/v1/jobs/{id}/completions``: a generation job's output (``core.jobs.completions``), and
``POST /v1/jobs/generate/preview``: a generation spec checked without creating the job.

Submitting, cancelling and resuming a generation job are the jobs routes' (``api.jobs.routes``:
``POST /v1/jobs`` with ``kind: generate``, ``/cancel``, ``/resume``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from api.auth import CallerDep
from api.deps import SessionDep, StateDep
from api.jobs.schemas import PreflightOut
from api.jobs.submit import generation_report
from core.jobs import completions, service
from core.jobs.generate_spec import GenerateSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("/generate/preview", summary="Check a generation job without creating it")
async def preview_generation(spec: GenerateSpec, state: StateDep, caller: CallerDep) -> PreflightOut:
    """The checks ``POST /v1/jobs`` runs on a ``kind: generate`` body: the prompts file (yours, of the
    project, purpose=generate), the model (a base, ``job:<id>``, ``job:<id>@<step>``,
    ``export:<id>``) and, for a local model, each prompt + ``sampling.max_tokens`` within its context;
    the report counts the prompts and their tokens. 422 naming the field (and a prompt's line) otherwise."""
    return PreflightOut.model_validate(await generation_report(state, spec, caller))


@router.get("/{job_id}/completions", response_class=FileResponse,
            responses={200: {"content": {"application/jsonl": {}}}},
            summary="Download a generation job's completions.jsonl")
def download_completions(job_id: str, session: SessionDep, state: StateDep, caller: CallerDep) -> FileResponse:
    """One JSON line per prompt, in prompt order: ``index``, the prompt (``prompt`` or ``messages``),
    ``choices`` (``text``, ``finish_reason``, ``tokens``, ``logprobs`` when asked) and ``usage``.
    409 until the job has succeeded."""
    job = service.get_job(session, job_id, reader=caller)
    path = completions.completions_file(state.settings, job)
    session.close()
    return FileResponse(path, media_type="application/jsonl", filename=f"{job_id}-completions.jsonl")


@router.get("/{job_id}/completions/preview", summary="The first completions written so far")
def preview_completions(job_id: str, session: SessionDep, state: StateDep, caller: CallerDep,
                        limit: Annotated[int, Query(ge=1, le=completions.MAX_PREVIEW)] = 5) -> dict[str, Any]:
    """``{"data": [...]}``: the first ``limit`` lines of completions.jsonl as they are now (while the
    job runs, those of the first prompts already done, in order)."""
    job = service.get_job(session, job_id, reader=caller)
    return {"object": "list", "data": completions.preview(state.settings, job, limit)}
