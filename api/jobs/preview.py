"""Submission-time checks of a job's model and data, and ``POST /v1/jobs/preview``.

``preflight_for`` runs before a job is created (and alone for the preview): the caller may use
the files, the model resolves, a local model's files agree with its config.json
(``core.jobs.model_source.check_model_files``), and the dataset is tokenized with the model's own
tokenizer and chat template in a tokenizer-pool process (``core.jobs.preflight``), so the API's
event loop never waits on transformers. A hub model whose tokenizer is not in the local cache
cannot be checked here (the worker downloads it): its report says so (``checked: false``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anyio import to_thread

from api.state import AppState
from core.errors import InvalidInput
from core.jobs import preflight, service
from core.jobs.model_source import ModelSource, check_model_files, resolve_model
from core.jobs.spec import JobSpec
from core.users import access
from core.users.service import Caller


async def preflight_for(state: AppState, spec: JobSpec, caller: Caller) -> dict[str, Any]:
    """The preflight report of ``spec`` (``api.jobs.schemas.PreflightOut``).

    Raises:
        InvalidInput: a file, the model or the data cannot train (the message names the field).
        Forbidden: the caller may not use a file.
    """
    located = await to_thread.run_sync(_locate, state, spec, caller)
    source, model_type, train, validation = located
    formats = {train[1], validation[1] if validation else train[1]}
    if spec.objective != "sft" or "preference" in formats:
        return preflight.unchecked("preference records: the preflight counts SFT records only")
    assert state.tokenizers is not None, "the lifespan creates the tokenizer pool"
    try:
        return await state.tokenizers.run(preflight.checked_report, spec.model, source, model_type, train,
                                          validation, spec.hyperparameters.max_seq_len)
    except InvalidInput as exc:
        if source.kind == "hub" and exc.param == "model":
            return preflight.unchecked(
                f"the dataset was not checked: the tokenizer of {spec.model} is not in this box's Hugging "
                "Face cache (the worker downloads it)")
        raise


def _locate(state: AppState, spec: JobSpec, caller: Caller) -> tuple[ModelSource, str | None, tuple[str, str],
                                                                      tuple[str, str] | None]:
    settings = state.settings
    with state.sessions() as session:
        access.require_usable_files(
            session, caller, {"training_file": spec.training_file, "validation_file": spec.validation_file}
        )
        row = service.usable_file(session, spec.training_file, "train", "training_file")
        train = (row.path, row.format)
        validation = None
        if spec.validation_file is not None:
            row = service.usable_file(session, spec.validation_file, "validation", "validation_file")
            validation = (row.path, row.format)
    source = resolve_model(spec.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models,
                           check_hub=True)
    model_type = None
    if source.kind == "local":
        model_type = str(check_model_files(Path(source.name_or_path), spec.model)["model_type"])
    return source, model_type, train, validation
