"""Batch generation jobs in the store: which model a spec names, the checks before it is queued,
and the trainer's ``GenerateConfig`` the worker writes as job.json.

A ``model`` of a generation job is one of

    <base>              as a training job's model (``core.jobs.model_source``: the model root, the hub)
    job:<id>            that training job's final weights: its LoRA adapter on its base (unmerged),
                        or the whole model of a method ``full`` job; the job must have succeeded
                        (a ``full`` job's ``model/`` saved before it carried tokenizer files is
                        loaded with its base's tokenizer and chat template: ``ResolvedModel.tokenizer``)
    job:<id>@<step>     the LoRA adapter of one of its checkpoints (a ``full`` job's checkpoints are
                        sharded optimizer state, not a loadable model: use its final weights)
    export:<id>         a succeeded ``merged`` export (a GGUF file is llama.cpp's, not torch's)
    ft:<...>:<id>       an OpenAI-style fine-tuned name (``core.openai.catalog``) as ``job:<id>[@<step>]``
                        (``ft_reference``; an eval's judges and runs take them)

A job or export of another project is refused as an unknown one, as files are
(``core.jobs.admission.usable_file``): the caller is a member of the new job's project, so what
it may name is what that project holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core.errors import InvalidInput
from core.exports.models import Export
from core.jobs import artifact_store
from core.jobs.admission import usable_file
from core.jobs.eval_spec import EvalJobSpec
from core.jobs.generate_spec import EXPORT_REF, JOB_REF, GenerateSpec
from core.jobs.model_source import resolve_model
from core.jobs.models import Checkpoint, Job
from core.jobs.scheduling import check_gpus, check_project
from core.jobs.states import JobStatus
from core.settings import Settings
from trainer.evals.config import EvalConfig
from trainer.training import layout
from trainer.generate.job_config import GenerateConfig

PURPOSE = "generate"
"""The files API purpose of a prompts file."""

Fetch = Callable[[str, str], Path]
"""``(job id, artifact path)`` → that artifact of a job's store on this machine: the API's data
directory read in place (``in_store``), or a remote worker's download of it (worker/remote_generation.py)."""
Files = Callable[[Session, list[str]], dict[str, str]]
"""file ids → their paths on this machine (``core.files.service.paths_for``, or a remote worker's downloads)."""


@dataclass(frozen=True)
class ResolvedModel:
    """What the trainer loads for a generation job's ``model``."""

    model: str
    """A directory or hub id: the base, a full fine-tune's weights, or a merged export."""
    adapter: str | None = None
    """A LoRA adapter directory applied unmerged on ``model``."""
    tokenizer: str | None = None
    """Where the tokenizer (and so the chat template) loads from when ``model`` has none: the
    base (directory or hub id) of a full fine-tune whose ``model/`` was saved without tokenizer
    files (ftq did so until full jobs' ``model/`` carried the tokenizer it trained with, which is
    the base's). None: ``model``'s own."""


FT_CHECKPOINT = re.compile(r":ckpt-step-(?P<step>[0-9]{1,18})$")
"""The tail of an ``ft:`` name of one of a job's checkpoints."""
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files any saved Hugging Face tokenizer has one of (``save_pretrained``)."""


def has_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds tokenizer files (``TOKENIZER_FILES``)."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def admit_generation(session: Session, spec: GenerateSpec, *, settings: Settings, owner_id: str | None,
                     project_id: str | None) -> ResolvedModel:
    """Check that the box can run ``spec`` for ``owner_id`` in ``project_id``; writes nothing.

    Raises:
        InvalidInput: the prompts file is unknown, deleted, of another project or purpose; the
            model cannot be resolved (see the module docstring); a priority over the project's.
        Unsupported: ``gpus`` no live host, the owner's cap or the project's quota can give.
    """
    check_gpus(session, spec.gpus, settings, owner_id=owner_id, nodes=1)
    check_project(session, project_id, spec.gpus, spec.priority)
    usable_file(session, spec.prompts_file, PURPOSE, "prompts_file", project_id)
    return resolve(session, spec.model, settings=settings, project_id=project_id, check_hub=True)


def preflight(session: Session, spec: GenerateSpec, *, settings: Settings, project_id: str | None) -> dict[str, Any]:
    """The submission report of ``spec`` (``api.jobs.schemas.PreflightOut``'s shape): the prompts the
    upload validated (``core.files.validate.validate_prompts``) and the model resolved.

    Raises:
        InvalidInput: the prompts file or the model (the message names the field).
    """
    row = usable_file(session, spec.prompts_file, PURPOSE, "prompts_file", project_id)
    resolved = resolve(session, spec.model, settings=settings, project_id=project_id, check_hub=True)
    stats = row.stats or {}
    note = f"{row.num_records} prompts ({stats.get('chat_prompts', 0)} chat, {stats.get('text_prompts', 0)} text)"
    if resolved.adapter:
        note += "; the adapter is applied unmerged on its base"
    if resolved.tokenizer:
        note += (f"; the model's directory has no tokenizer (saved before full fine-tunes kept one), so the base's "
                 f"tokenizer and chat template are used ({resolved.tokenizer})")
    return {"checked": True, "format": row.format, "records": row.num_records, "note": note}


def in_store(settings: Settings) -> Fetch:
    """Artifacts read in place from the API's data directory (the API, a local worker)."""
    return lambda job_id, path: artifact_store.artifact_path(settings, job_id, path)


def resolve(session: Session, model: str, *, settings: Settings, project_id: str | None,
            check_hub: bool = False, fetch: Fetch | None = None) -> ResolvedModel:
    """The directories (or hub id) behind ``model``; ``InvalidInput`` naming ``model`` otherwise.

    ``fetch`` brings a job's weights to this machine (default: read in place, ``in_store``); the
    base is resolved on this machine's model root (or the hub) either way."""
    fetch = fetch or in_store(settings)
    if (ref := JOB_REF.match(model)) is not None:
        source = _source_job(session, ref["job_id"], project_id)
        if ref["step"] is None:
            return _final_weights(source, settings, fetch, check_hub)
        return _checkpoint(session, source, int(ref["step"]), settings, fetch)
    if (ref := EXPORT_REF.match(model)) is not None:
        return _export(session, ref["export_id"], project_id, fetch)
    source = resolve_model(model, model_root=settings.model_root, allow_hub=settings.allow_hub_models,
                           check_hub=check_hub)
    return ResolvedModel(source.name_or_path)


def ft_reference(model: str) -> str:
    """An ``ft:`` name (``ft:<base>:<org>::<job id>[:ckpt-step-N]``) as ``job:<id>[@<step>]``; any
    other name as it is. Reading it is the caller's check (``core.openai.catalog.get_model``)."""
    if not model.startswith("ft:"):
        return model
    step = FT_CHECKPOINT.search(model)
    job_id = (model[:step.start()] if step else model).rpartition(":")[2]
    return f"job:{job_id}@{step['step']}" if step else f"job:{job_id}"


def resolve_judge(session: Session, model: str, param: str, *, settings: Settings, project_id: str | None,
                  check_hub: bool = False, fetch: Fetch | None = None) -> ResolvedModel:
    """A model grader's judge (its ``model``, at ``param``), resolved as a run's model is (``resolve``);
    ``InvalidInput`` naming ``<param>.model`` otherwise."""
    try:
        return resolve(session, ft_reference(model), settings=settings, project_id=project_id, check_hub=check_hub,
                       fetch=fetch)
    except InvalidInput as exc:
        raise InvalidInput(f"{param}.model: {exc.message.removeprefix('model: ')}", param=f"{param}.model") from None


def resolve_judges(session: Session, criteria: list[dict[str, Any]], *, settings: Settings, project_id: str | None,
                   fetch: Fetch | None = None) -> dict[str, dict[str, str | None]]:
    """``EvalConfig.judges``: each judge model the criteria's model graders name, resolved on this machine."""
    # Here, not at the top: the worker imports this module and keeps to the trainer's job-file modules
    # (tests/unit/worker/test_worker_boundaries.py); the graders come in only for an eval run's judges.
    from trainer.graders import model_graders

    judges: dict[str, dict[str, str | None]] = {}
    for i, criterion in enumerate(criteria):
        for param, grader in model_graders(criterion, f"testing_criteria[{i}]"):
            if grader["model"] not in judges:
                found = resolve_judge(session, grader["model"], param, settings=settings, project_id=project_id,
                                      fetch=fetch)
                judges[grader["model"]] = {"model": found.model, "adapter": found.adapter,
                                           "tokenizer": found.tokenizer}
    return judges


def _refuse(message: str) -> InvalidInput:
    return InvalidInput(f"model: {message}", param="model")


def _source_job(session: Session, job_id: str, project_id: str | None) -> Job:
    job = session.get(Job, job_id)
    if job is None or project_id not in (None, job.project_id) or job.kind != "train":
        raise _refuse(f"no training job {job_id!r} in this project; list jobs with GET /v1/jobs")
    return job


def _base(job: Job, settings: Settings) -> str:
    return resolve_model(job.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models).name_or_path


def _final_weights(job: Job, settings: Settings, fetch: Fetch, check_hub: bool) -> ResolvedModel:
    if job.status != JobStatus.succeeded.value:
        raise _refuse(f"job {job.job_id} is {job.status}: its final weights exist once it has succeeded; "
                      f"name one of its checkpoints (job:{job.job_id}@<step>, GET /v1/jobs/{job.job_id}/checkpoints)")
    weights = fetch(job.job_id, layout.export_name(job.method))
    if not weights.is_dir():
        raise _refuse(f"job {job.job_id} succeeded but its weights are not on disk ({weights.name}/)")
    if job.method == "full":
        return ResolvedModel(str(weights), tokenizer=None if has_tokenizer(weights) else
                             _tokenizer_base(job, settings, check_hub))
    return ResolvedModel(_base(job, settings), str(weights))


def _tokenizer_base(job: Job, settings: Settings, check_hub: bool) -> str:
    """The base a full job trained from, for the tokenizer its ``model/`` lacks; resolved on this
    machine (a remote worker's model root or hub, as any base), refused naming ``model`` if absent."""
    try:
        return resolve_model(job.model, model_root=settings.model_root, allow_hub=settings.allow_hub_models,
                             check_hub=check_hub).name_or_path
    except InvalidInput as exc:
        raise _refuse(f"job {job.job_id}'s model/ has no tokenizer files (it finished before full fine-tunes saved "
                      f"one), so its base {job.model!r}, which it trained with, provides the tokenizer and chat "
                      f"template, and the base is not available here: {exc.message}") from None


def _checkpoint(session: Session, job: Job, step: int, settings: Settings, fetch: Fetch) -> ResolvedModel:
    if job.method == "full":
        raise _refuse(f"job {job.job_id} trained the full model: its checkpoints are sharded training state; "
                      f"name its final weights (job:{job.job_id}) or export it")
    if session.get(Checkpoint, (job.job_id, step)) is None:
        raise _refuse(f"job {job.job_id} has no checkpoint at step {step}; list them with "
                      f"GET /v1/jobs/{job.job_id}/checkpoints")
    path = fetch(job.job_id, f"{layout.CHECKPOINTS}/{layout.checkpoint_name(step)}")
    if not (path / "adapter_config.json").is_file():
        raise _refuse(f"job {job.job_id} has no checkpoint at step {step}; list them with "
                      f"GET /v1/jobs/{job.job_id}/checkpoints")
    return ResolvedModel(_base(job, settings), str(path))


def _export(session: Session, export_id: str, project_id: str | None, fetch: Fetch) -> ResolvedModel:
    export = session.get(Export, export_id)
    if export is None or project_id not in (None, export.project_id):
        raise _refuse(f"no export {export_id!r} in this project; list a job's exports with "
                      "GET /v1/jobs/{id}/exports")
    if export.format != "merged":
        raise _refuse(f"export {export_id} is a {export.format} file, which the sampler cannot load; name a "
                      "merged export, or the job itself (job:<id>)")
    if export.status != "succeeded":
        raise _refuse(f"export {export_id} is {export.status}; name it once it has succeeded")
    path = fetch(export.job_id, f"{layout.EXPORTS}/{export_id}")
    if not (path / "config.json").is_file():
        raise _refuse(f"export {export_id} succeeded but its weights are not on disk")
    return ResolvedModel(str(path))


def to_generate_config(spec: GenerateSpec, resolved: ResolvedModel, *, job_id: str, prompts_path: str,
                       output_dir: str) -> GenerateConfig:
    """The trainer's job.json for ``spec`` (``trainer.generate.job_config``)."""
    sampling = spec.sampling.model_dump(mode="json")
    return GenerateConfig(model=resolved.model, adapter=resolved.adapter, tokenizer=resolved.tokenizer,
                          prompts_file=prompts_path,
                          output_dir=output_dir, sampling=sampling, chunk_prompts=spec.chunk_prompts, job_id=job_id)


def build_generate_config(session: Session, job: Job, *, settings: Settings, output_dir: str,
                          fetch: Fetch | None = None, files_for: Files | None = None) -> GenerateConfig:
    """The stored generation spec → ``GenerateConfig`` on the worker, the model resolved again.

    ``fetch`` and ``files_for`` bring the weights and the prompts file to this machine (a remote
    worker downloads them through the API); by default they are read in the API's data directory.

    Raises:
        InvalidInput: the prompts file was deleted, or the model is no longer there.
        worker.transfer.TransferError: a remote worker's download failed (retried as a dataset's).
    """
    from core.files.service import paths_for

    spec = (EvalJobSpec if job.kind == "eval" else GenerateSpec).model_validate(job.spec)
    files = (files_for or paths_for)(session, [spec.prompts_file])
    path = files.get(spec.prompts_file)
    if path is None or not Path(path).is_file():
        raise InvalidInput(f"prompts_file {spec.prompts_file} was deleted after the job was submitted; upload it "
                           "again and resubmit", param="prompts_file")
    resolved = resolve(session, spec.model, settings=settings, project_id=job.project_id, fetch=fetch)
    config = to_generate_config(spec, resolved, job_id=job.job_id, prompts_path=path, output_dir=output_dir)
    if isinstance(spec, EvalJobSpec):  # an eval run: the same generation, each line graded (trainer.evals)
        sandbox = {"cpu_s": settings.grader_cpu_s, "wall_s": settings.grader_wall_s,
                   "memory_bytes": settings.grader_memory_mib << 20}
        judges = {} if spec.lm_eval is not None else resolve_judges(
            session, spec.testing_criteria, settings=settings, project_id=job.project_id, fetch=fetch)
        fields = {**config.to_dict(), "kind": "eval", "testing_criteria": spec.testing_criteria, "sandbox": sandbox,
                  "judges": judges, "lm_eval": spec.lm_eval}
        return EvalConfig.from_dict(fields)
    return config
