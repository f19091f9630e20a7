"""Between OpenAI's objects and ftq's store: a create request becomes a native ``JobSpec`` (plus
the ``openai_job`` row), and ftq's rows are shown back as OpenAI's files and jobs.

A W&B integration (``integrations: [{"type": "wandb", "wandb": {project, name, entity, tags}}]``)
becomes the spec's ``tracking.wandb_*``: the worker runs the W&B run (``worker.tracking.wandb``).

One store: a job made here is an ordinary ftq job (``/v1/jobs``, the CLI, the dashboard show it,
its ``name`` is the suffix), and ``/openai/v1`` shows every ftq job, those made natively too.

Status: ftq validates files at upload and the spec at submission, so a job is never seen in
``validating_files``; ``queued``, ``running``, ``succeeded``, ``failed`` and ``cancelled`` are
ftq's own; a paused job (stopped with a checkpoint, ``api.openai.jobs``) reads ``paused``.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from pydantic import ValidationError

from api.openai import auto
from api.openai.schemas import (
    FileObject,
    FineTuningJob,
    Hyperparameters,
    JobCreate,
    JobError,
    ReinforcementMethod,
    WandbIntegration,
)
from core.errors import InvalidInput, Unsupported
from core.files.models import File
from core.jobs.models import Job
from core.jobs.spec import JobSpec
from core.jobs.trackers import asked_for
from core.openai.catalog import ORGANIZATION, fine_tuned_model
from core.openai.models import OpenAIJob
from trainer import objectives

RESULTS_PREFIX = "file-results-"
"""A job's metrics CSV is ``file-results-<24 hex of the job id>``: made on request, never stored."""
DEFAULT_OBJECTIVE = JobSpec.model_fields["objective"].default
SECTION_HYPERPARAMETERS = {"dpo": ("beta",)}
"""OpenAI's method hyperparameters that are an objective's setting (``dpo.beta``): copied between
``method.<type>.hyperparameters`` and the objective's section. A reinforcement job's grader is its
``grpo.graders``, and its ``compute_multiplier`` its ``grpo.group_size`` over ``auto.GROUP_SIZE``."""
METHODS = ("supervised", "dpo", "reinforcement")
SUFFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def method_of(body: JobCreate) -> tuple[str, dict[str, Any]]:
    """``(type, requested hyperparameters)`` from ``method``, else the older ``hyperparameters``.

    Raises:
        Unsupported: a reinforcement hyperparameter ftq has no use for, set.
        InvalidInput: both forms at once, a method whose hyperparameters sit under another type, a
            reinforcement method without its grader.
    """
    if body.method is None:
        legacy = body.hyperparameters.model_dump() if body.hyperparameters else {}
        return "supervised", legacy
    kind = body.method.type
    for other in METHODS:
        if other != kind and getattr(body.method, other) is not None:
            raise InvalidInput(
                f"method.{other}: given with method.type '{kind}'; put the settings under method.{kind}",
                param=f"method.{other}",
            )
    if body.hyperparameters is not None:
        raise InvalidInput(
            "hyperparameters: give them under method.<type>.hyperparameters or in the older top-level "
            "'hyperparameters', not both",
            param="hyperparameters",
        )
    chosen = getattr(body.method, kind)
    if kind == "reinforcement":
        _check_reinforcement(chosen)
    return kind, chosen.hyperparameters.model_dump() if chosen is not None else {}


def _check_reinforcement(method: ReinforcementMethod | None) -> None:
    """A grader is needed; the hyperparameters ftq's GRPO has no use for must be left to default."""
    where = "method.reinforcement"
    if method is None:
        raise InvalidInput(f"{where}.grader: a reinforcement job needs a grader (the reward; docs/graders.md)",
                           param=f"{where}.grader")
    hyper = method.hyperparameters
    for name in ("eval_interval", "eval_samples"):
        if getattr(hyper, name) != "auto":
            raise Unsupported(f"{where}.hyperparameters.{name}: ftq's reinforcement jobs run no evals during "
                              "training (each step's reward_mean is in its metrics); leave it 'auto'",
                              param=f"{where}.hyperparameters.{name}")
    if hyper.reasoning_effort != "default":
        raise Unsupported(f"{where}.hyperparameters.reasoning_effort: ftq samples through the model's chat template "
                          "as it is; leave it 'default'", param=f"{where}.hyperparameters.reasoning_effort")


def check_suffix(suffix: str | None) -> None:
    if suffix is not None and not set(suffix) <= SUFFIX_CHARS:
        raise InvalidInput(
            f"suffix: {suffix!r} may hold only letters, digits, '-' and '_' (it becomes part of "
            "fine_tuned_model)",
            param="suffix",
        )


def native_spec(body: JobCreate, train: File, *, validation_file: str | None,
                kind: str, requested: dict[str, Any]) -> tuple[JobSpec, auto.Resolved]:
    """The native job spec for ``body`` whose training file is ``train`` (hyperparameters
    resolved from it); ``validation_file`` is the ftq file id to validate on.

    Raises:
        InvalidInput: the spec the translation gives is refused (the message names the field).
    """
    dpo = kind == "dpo"
    resolved = auto.resolve(requested, num_records=train.num_records, dpo=dpo, reinforcement=kind == "reinforcement")
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    raw: dict[str, Any] = {
        "name": body.suffix,
        "model": body.model,
        "training_file": train.file_id,
        "validation_file": validation_file,
        "hyperparameters": auto.ftq_hyperparameters(resolved, train.stats or {}, seed=seed, dpo=dpo),
        # About once per epoch, as OpenAI keeps a checkpoint per epoch.
        "checkpoint_every": auto.steps_per_epoch(resolved, train.num_records),
    }
    raw.update(_objective_of(kind, resolved, grader_of(body)))
    if body.integrations:
        raw["tracking"] = tracking_of(body.integrations[0].wandb)
    try:
        return JobSpec.model_validate(raw), resolved
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise InvalidInput(f"the job this request describes is refused: {where}: {err['msg']}") from None


def tracking_of(wandb: WandbIntegration) -> dict[str, Any]:
    """OpenAI's W&B integration as the spec's ``tracking``: the worker runs the W&B run itself, with
    its own ``WANDB_API_KEY`` (OpenAI's comes from the organization's settings, never the request)."""
    return {"wandb": True, "wandb_project": wandb.project, "wandb_entity": wandb.entity,
            "wandb_name": wandb.name, "wandb_tags": wandb.tags or []}


def integrations_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``integrations`` a job shows: its W&B tracking, if its spec turns it on (``project`` null:
    the worker's ``FTQ_WANDB_PROJECT``, else ftq)."""
    tracking = spec.get("tracking") or {}
    if "wandb" not in asked_for(tracking):
        return []
    wandb = {"project": tracking.get("wandb_project"), "name": tracking.get("wandb_name"),
             "entity": tracking.get("wandb_entity"), "tags": tracking.get("wandb_tags") or []}
    return [{"type": "wandb", "wandb": wandb}]


def grader_of(body: JobCreate) -> dict[str, Any] | None:
    """A reinforcement request's grader."""
    method = body.method.reinforcement if body.method is not None else None
    return method.grader if method is not None else None


def method_dict(kind: str, resolved: auto.Resolved, grader: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": kind, kind: {**({"grader": grader} if grader is not None else {}),
                                 "hyperparameters": resolved.as_openai()}}


def file_object(row: File) -> FileObject:
    return FileObject(
        id=row.file_id,
        bytes=row.bytes,
        created_at=_unix(row.created_at),
        filename=row.filename,
        purpose="evals" if row.purpose == "evals" else "fine-tune",
    )


def results_file_id(job_id: str) -> str:
    return RESULTS_PREFIX + job_id.removeprefix("job-")


def job_of_results_file(file_id: str) -> str | None:
    """The job id behind a results file id; None for any other id."""
    return "job-" + file_id.removeprefix(RESULTS_PREFIX) if file_id.startswith(RESULTS_PREFIX) else None


def fine_tuning_job(job: Job, extra: OpenAIJob | None, *, owner: str | None, trained_tokens: int | None,
                    estimated_finish: int | None, has_metrics: bool,
                    evals: list[dict[str, Any]] | None = None) -> FineTuningJob:
    """``job`` as OpenAI shows it; ``extra`` is its ``openai_job`` row (None for a native job);
    ``evals``: ``core.evals.after_training.summary`` of it."""
    method = extra.method if extra is not None else _native_method(job)
    kind = method["type"]
    hyper = Hyperparameters.model_validate(method.get(kind, {}).get("hyperparameters", {}))
    status = job.status
    if extra is not None and extra.paused_at is not None and status == "cancelled":
        status = "paused"
    finished = status in ("succeeded", "failed", "cancelled")
    suffix = extra.suffix if extra is not None else job.name
    return FineTuningJob(
        id=job.job_id,
        created_at=_unix(job.created_at),
        error=JobError(code=job.error_code, message=job.error_message or job.error_code)
        if status == "failed" and job.error_code else None,
        fine_tuned_model=fine_tuned_model(job, owner, suffix) if status == "succeeded" else None,
        finished_at=_unix(job.finished_at) if finished and job.finished_at else None,
        hyperparameters=Hyperparameters(
            batch_size=hyper.batch_size, learning_rate_multiplier=hyper.learning_rate_multiplier,
            n_epochs=hyper.n_epochs,
        ),
        model=job.model,
        organization_id=ORGANIZATION,
        result_files=[results_file_id(job.job_id)] if finished and has_metrics else [],
        seed=int(job.spec.get("hyperparameters", {}).get("seed", 0)),
        status=status,
        trained_tokens=trained_tokens if finished else None,
        training_file=extra.training_file if extra is not None else job.training_file_id,
        validation_file=extra.validation_file if extra is not None else job.validation_file_id,
        estimated_finish=estimated_finish if status == "running" else None,
        integrations=integrations_of(job.spec),
        metadata=extra.user_metadata if extra is not None else None,
        method=method,
        user_provided_suffix=suffix,
        evals=evals,
    )


def _native_method(job: Job) -> dict[str, Any]:
    """A job submitted to ``/v1/jobs`` in OpenAI's terms (what can be said of it)."""
    spec = job.spec
    hp = spec.get("hyperparameters", {})
    epochs = hp.get("epochs")
    hyper: dict[str, Any] = {
        "n_epochs": int(epochs) if epochs is not None and float(epochs).is_integer() else None,
        "learning_rate_multiplier": round(hp.get("learning_rate", auto.BASE_LEARNING_RATE) / auto.BASE_LEARNING_RATE, 6),
    }
    declared = objectives.declaration(spec.get("objective", DEFAULT_OBJECTIVE))
    section = spec.get(declared.name) or {}
    method = declared.openai_method or "supervised"
    hyper.update({k: section.get(k) for k in SECTION_HYPERPARAMETERS.get(method, ()) if k in section})
    if method != "reinforcement":
        return {"type": method, method: {"hyperparameters": hyper}}
    hyper["compute_multiplier"] = round(section.get("group_size", auto.GROUP_SIZE) / auto.GROUP_SIZE, 4)
    return {"type": method, method: {"grader": section.get("graders"), "hyperparameters": hyper}}


def _objective_of(kind: str, resolved: auto.Resolved, grader: dict[str, Any] | None) -> dict[str, Any]:
    """The spec's ``objective`` and its section for OpenAI's ``method.type`` ``kind`` (``trainer.objectives``)."""
    declared = objectives.for_openai_method(kind)
    if declared is None or declared.name == DEFAULT_OBJECTIVE:
        return {}
    section = {k: getattr(resolved, k) for k in SECTION_HYPERPARAMETERS.get(kind, ()) if k in _section_fields(declared)}
    if kind == "reinforcement":
        section.update(graders=grader, group_size=resolved.group_size)
    return {"objective": declared.name, **({declared.name: section} if section else {})}


def _section_fields(declared: objectives.Declaration) -> set[str]:
    return {f.name for f in dataclasses.fields(declared.section)} if declared.section else set()


def _unix(when: Any) -> int:
    return int(when.timestamp())
