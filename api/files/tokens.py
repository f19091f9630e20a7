"""``GET /v1/files/{file_id}/tokens``: token statistics of a dataset under one model's tokenizer.

The upload response counts characters only, because it does not know the model yet. Once the
user has picked one, this route tokenizes every record exactly as training will
(``trainer.dataset.tokenize_record``: the chat template, loss on assistant tokens only), so the
dashboard can show how many tokens a run would see and how many records ``max_seq_len`` cuts.
The tokenizing runs in the app state's ``TokenizerPool`` (``api.files.tokenizer_pool``): worker
processes that keep the tokenizers loaded, so the API process never imports transformers; each
record is held to the per-record bounds first, and the request to the pool's time budget.
"""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.auth import CallerDep
from api.deps import StateDep
from api.jobs.preview import record_bounds
from core.files import service
from core.jobs.model_source import ModelSource, resolve_model
from core.jobs.spec import JobSpec

router = APIRouter(tags=["files"])
"""Included by ``api.files.routes.router``, which adds the ``/v1/files`` prefix."""


@router.get(
    "/{file_id}/tokens",
    summary="Token statistics of a dataset under a model's tokenizer, tokenized as training does",
)
async def file_tokens(
    file_id: str,
    state: StateDep,
    caller: CallerDep,
    model: Annotated[str, Query(description="The model as POST /v1/jobs accepts it")],
    max_seq_len: Annotated[
        int, Query(ge=1, description="Count the records longer than this")
    ] = 4096,
) -> dict[str, Any]:
    """Errors: 404 unknown file; 422 a model the box cannot resolve or whose tokenizer it lacks, a
    record over the per-record bounds, or tokenizing that ran past the time budget (naming the line)."""
    check_model(model)
    settings = state.settings

    def locate() -> tuple[str, str, ModelSource]:
        with state.sessions() as session:
            row = service.get_file(session, file_id, reader=caller)
            path, fmt = row.path, row.format
        source = resolve_model(
            model, model_root=settings.model_root, allow_hub=settings.allow_hub_models
        )
        return path, fmt, source

    path, fmt, source = await to_thread.run_sync(locate)
    assert state.tokenizers is not None, "the lifespan creates the tokenizer pool"
    stats = await state.tokenizers.token_stats(path, fmt, model, source, max_seq_len=max_seq_len,
                                               bounds=record_bounds(settings), user=caller.user_id)
    return stats | {"file_id": file_id, "model": model}


def check_model(model: str) -> None:
    """Check ``model`` as ``POST /v1/jobs`` checks its ``model`` (``JobSpec.model``: length, no
    surrounding whitespace), so the two routes answer the same name with the same 422.

    Raises:
        RequestValidationError: naming the query parameter ``model``.
    """
    try:
        JobSpec.model_validate({"model": model, "training_file": "-"})
    except ValidationError as exc:
        errors = [err for err in exc.errors() if err["loc"][:1] == ("model",)]
        if errors:
            raise RequestValidationError([{**err, "loc": ("query", "model")} for err in errors]) from None
