"""OpenAI's fine-tuning objects, as the official ``openai`` client reads and sends them.

Responses follow the client's types (``openai.types.FileObject``,
``openai.types.fine_tuning.FineTuningJob``, ``FineTuningJobEvent``, ``FineTuningJobCheckpoint``):
times are Unix seconds, lists are ``{"object": "list", "data", "has_more", "first_id",
"last_id"}``. Requests refuse unknown fields as OpenAI does ("Unrecognized request argument").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Auto = Literal["auto"]
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on a job's ``metadata``."""


class _Request(BaseModel):
    # Strict as OpenAI is: "3" is not an integer, "auto" is the only string a hyperparameter takes.
    model_config = ConfigDict(extra="forbid", strict=True)


class SupervisedHyperparameters(_Request):
    batch_size: Auto | Annotated[int, Field(ge=1, le=256)] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=10)] = "auto"
    n_epochs: Auto | Annotated[int, Field(ge=1, le=50)] = "auto"


class DpoHyperparameters(SupervisedHyperparameters):
    beta: Auto | Annotated[float, Field(gt=0, le=2)] = "auto"


class ReinforcementHyperparameters(SupervisedHyperparameters):
    compute_multiplier: Auto | Annotated[float, Field(gt=0, le=10)] = "auto"
    """Scales the completions sampled per prompt (``grpo.group_size``: 8 at 1)."""
    eval_interval: Auto | Annotated[int, Field(ge=1)] = "auto"
    eval_samples: Auto | Annotated[int, Field(ge=1)] = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class SupervisedMethod(_Request):
    hyperparameters: SupervisedHyperparameters = SupervisedHyperparameters()


class DpoMethod(_Request):
    hyperparameters: DpoHyperparameters = DpoHyperparameters()


class ReinforcementMethod(_Request):
    """OpenAI's reinforcement fine-tuning: ftq's ``grpo`` objective with this grader (docs/grpo.md)."""

    grader: dict[str, Any]
    hyperparameters: ReinforcementHyperparameters = ReinforcementHyperparameters()


class MethodIn(_Request):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    reinforcement: ReinforcementMethod | None = None


class WandbIntegration(_Request):
    """OpenAI's ``integrations[].wandb``: the W&B run the job reports to (``tracking.wandb_*``)."""

    project: Annotated[str, Field(min_length=1, max_length=128)]
    name: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    entity: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    tags: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]] | None, Field(max_length=50)] = None


class Integration(_Request):
    type: Literal["wandb"]
    wandb: WandbIntegration


class JobCreate(_Request):
    """The body of ``fine_tuning.jobs.create``."""

    model: Annotated[str, Field(min_length=1, max_length=512)]
    training_file: Annotated[str, Field(min_length=1, max_length=64)]
    validation_file: Annotated[str | None, Field(max_length=64)] = None
    hyperparameters: SupervisedHyperparameters | None = None
    """The older form of ``method.supervised.hyperparameters``."""
    method: MethodIn | None = None
    suffix: Annotated[str | None, Field(min_length=1, max_length=64)] = None
    seed: Annotated[int | None, Field(ge=0, le=2**31 - 1)] = None
    metadata: Annotated[dict[str, str] | None, Field(description=(
        f"At most {METADATA_KEYS} string pairs, keys up to {METADATA_KEY_CHARS} characters, values up to "
        f"{METADATA_VALUE_CHARS} (OpenAI's limits)"))] = None
    integrations: Annotated[list[Integration] | None, Field(max_length=1)] = None
    """At most one, of type ``wandb``: the worker tracks the job on W&B (``api.openai.translate``)."""

    @field_validator("metadata", mode="before")
    @classmethod
    def _check_metadata(cls, value: Any) -> Any:
        """OpenAI's limits, checked before the types so that every break names ``metadata``."""
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ValueError(f"metadata must be an object of string keys and values, got {type(value).__name__}")
        if len(value) > METADATA_KEYS:
            raise ValueError(f"metadata has {len(value)} keys; at most {METADATA_KEYS} are allowed")
        for key, item in value.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"metadata key {key[:20]!r}... has {len(key)} characters; at most "
                                 f"{METADATA_KEY_CHARS} are allowed")
            if not isinstance(item, str):
                raise ValueError(f"metadata[{key!r}] is a {type(item).__name__}; values must be strings")
            if len(item) > METADATA_VALUE_CHARS:
                raise ValueError(f"metadata[{key!r}] has {len(item)} characters; at most {METADATA_VALUE_CHARS} "
                                 "are allowed")
        return value


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    """``fine-tune`` for uploads, ``fine-tune-results`` for a job's metrics CSV."""
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class Hyperparameters(BaseModel):
    batch_size: int | None = None
    learning_rate_multiplier: float | None = None
    n_epochs: int | None = None
    beta: float | None = None
    compute_multiplier: float | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    """``ft:<model>:<owner>:<suffix>:<job id>`` once succeeded: the ftq job whose adapter
    ``GET /v1/jobs/{id}/adapter`` (``ftq download``) downloads."""
    finished_at: int | None
    hyperparameters: Hyperparameters
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str
    """validating_files, queued, running, succeeded, failed, cancelled; ``paused`` between pause and resume."""
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] = []
    metadata: dict[str, str] | None = None
    method: dict[str, Any]
    user_provided_suffix: str | None = None
    evals: list[dict[str, Any]] | None = None
    """ftq's: the results of the evals the job names (its spec's ``evals``, docs/evals.md), per eval
    the base, tuned and checkpoint runs (id, status, counts) and each criterion's pass rates and
    difference; None for a job that names none. The ``openai`` client keeps it (``job.evals``)."""


class JobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class CheckpointMetrics(BaseModel):
    step: float
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class JobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class Page(BaseModel):
    """A cursor page: the next one starts ``after`` the last item's id."""

    object: Literal["list"] = "list"
    data: list[Any]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, items: list[Any], has_more: bool) -> Page:
        return cls(
            data=items,
            has_more=has_more,
            first_id=items[0].id if items else None,
            last_id=items[-1].id if items else None,
        )


class Model(BaseModel):
    """``openai.types.Model``: a base under the model root, a tuned job or one of its checkpoints."""

    id: str
    """The name a job names as ``model`` (a base), or ``fine_tuned_model`` / ``fine_tuned_model_checkpoint``."""
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    """``models.list``: one page holding every model, as OpenAI's (no ``has_more``)."""

    object: Literal["list"] = "list"
    data: list[Model]
