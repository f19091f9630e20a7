"""Submission-time checks of a job's model and data, and ``POST /v1/jobs/preview``.

``preflight_for`` runs before a job is created (and alone for the preview): the caller may use
the files, the model resolves, a local model's files agree with its config.json
(``core.jobs.model_source.check_model_files``), and the dataset is tokenized with the model's own
tokenizer and chat template in a tokenizer-pool process (``core.jobs.preflight``), so the API's
event loop never waits on transformers. A hub model whose tokenizer is not in the local cache
cannot be checked here (the worker downloads it): its report says so (``checked: false``). A GRPO
job's prompts, grader and completion length are checked by ``core.jobs.grpo_checks.report``. A
``max_steps`` that repeats the training file over and over is a warning either way
(``core.jobs.preflight.repeat_warning``). Each record is held to the per-record bounds before it
is tokenized (``record_bounds``), and the pool gives each caller a fair turn and each request a
time budget (``api.files.tokenizer_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyio import to_thread

from api.files.tokenizer_pool import OverBudget
from api.state import AppState
from core.errors import InvalidInput
from core.graders.service import limits_of
from core.jobs import admission, grpo_checks, preflight
from core.jobs.model_source import ModelSource, check_model_files, resolve_model
from core.jobs.spec import JobSpec
from core.settings import Settings
from core.users import access
from core.users.service import Caller


async def preflight_for(state: AppState, spec: JobSpec, caller: Caller) -> dict[str, Any]:
    """The preflight report of ``spec`` (``api.jobs.schemas.PreflightOut``).

    Raises:
        InvalidInput: a file, the model or the data cannot train (the message names the field).
        Forbidden: the caller may not use a file.
    """
    located = await to_thread.run_sync(_locate, state, spec, caller)
    report = await _dataset_report(state, spec, located, caller.user_id)
    if spec.objective == "grpo":  # sampling the same prompts step after step is how GRPO learns
        return report
    hp = spec.hyperparameters
    warning = preflight.repeat_warning(report, max_steps=hp.max_steps, micro_batches_per_step=hp.grad_accum * spec.gpus,
                                       batch_tokens=hp.batch_tokens, records=located.train_records)
    if warning:
        report["warnings"] = [*report.get("warnings", []), warning]
    return report


@dataclass(frozen=True)
class _Located:
    source: ModelSource
    model_type: str | None
    """A local model's config.json ``model_type``; None for a hub model."""
    train: tuple[str, str]
    """The training file's (path, format)."""
    validation: tuple[str, str] | None
    train_records: int
    context: int | None = None
    """A local model's config.json ``max_position_embeddings``; None where the API cannot read it."""


def record_bounds(settings: Settings) -> preflight.RecordBounds:
    """The per-record bounds of ``settings`` (``FTQ_RECORD_MAX_MESSAGES``, ``FTQ_RECORD_MAX_CHARS``)."""
    return preflight.RecordBounds(settings.record_max_messages, settings.record_max_chars)


async def _dataset_report(state: AppState, spec: JobSpec, located: _Located, user: str) -> dict[str, Any]:
    train, validation = located.train, located.validation
    formats = {train[1], validation[1] if validation else train[1]}
    if spec.objective == "grpo":
        return await to_thread.run_sync(grpo_checks.report, spec.grpo.model_dump(), train[0], train[1],
                                        located.context, limits_of(state.settings),
                                        spec.hyperparameters.batch_tokens)
    if spec.objective != "sft" or formats & {"preference", "prompts"}:  # admission names the file's misfit
        return preflight.unchecked(f"{spec.objective} on {', '.join(sorted(formats))} records: the preflight counts "
                                   "SFT records only")
    assert state.tokenizers is not None, "the lifespan creates the tokenizer pool"
    try:
        return await state.tokenizers.run(preflight.checked_report, spec.model, located.source, located.model_type,
                                          train, validation, spec.hyperparameters.max_seq_len,
                                          record_bounds(state.settings), user=user)
    except InvalidInput as exc:
        if located.source.kind == "hub" and exc.param == "model" and not isinstance(exc, OverBudget):
            return preflight.unchecked(
                f"the dataset was not checked: the tokenizer of {spec.model} is not in this box's Hugging "
                "Face cache (the worker downloads it)")
        raise


def _locate(state: AppState, spec: JobSpec, caller: Caller) -> _Located:
    settings = state.settings
    with state.sessions() as session:
        access.require_usable_files(
            session, caller, {"training_file": spec.training_file, "validation_file": spec.validation_file}
        )
        project_id = access.project_for_create(session, caller, spec.project)
        row = admission.usable_file(session, spec.training_file, "train", "training_file", project_id)
        train, train_records = (row.path, row.format), row.num_records
        validation = None
        if spec.validation_file is not None:
            row = admission.usable_file(session, spec.validation_file, "validation", "validation_file", project_id)
            validation = (row.path, row.format)
    source = resolve_model(spec.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models,
                           check_hub=True)
    model_type, context = None, None
    if source.kind == "local":
        config = check_model_files(Path(source.name_or_path), spec.model)
        model_type, context = str(config["model_type"]), config.get("max_position_embeddings")
    return _Located(source, model_type, train, validation, train_records,
                    context if isinstance(context, int) and not isinstance(context, bool) else None)
