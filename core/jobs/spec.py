"""The job spec: what a user may ask for in ``POST /v1/jobs``, validated at the door.

Every model forbids unknown fields and every range check says what to change, so nothing
reaches a GPU that could have been refused here. The validated spec is stored on the job as
JSON (defaults filled in) and translated to ``trainer.config.TrainConfig`` by
``core.jobs.translate.to_train_config``.

Types are strict: ``"5e-4"`` is not a number and ``1`` is not ``true``. A whole number where a
float is expected is taken (JSON writes ``1.0`` as ``1``); ``2.0`` where an integer is expected
is refused, as a string is, naming the field.

Length of training: set ``hyperparameters.max_steps`` or ``hyperparameters.epochs``, not
both. With neither, ``epochs`` is filled in as 1 (one pass), the least surprising default for
a dataset of unknown size; the stored spec shows it.

The optimization switches are not listed here: ``OptimizationSwitches`` is built from
``trainer.config.Optimizations`` (``SWITCHES``, ``switch_docs``), the one list, so a switch the
trainer gains is accepted here, shown in the API's schema and on the dashboard's form at once.
Methods and schedulers are ``trainer.catalog``'s lists in the same way.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator

from trainer import objectives
from trainer.catalog import METHODS, SCHEDULERS
from trainer.config import CHECKPOINTING_VALUES, SWITCH_VALUES, SWITCHES, switch_docs

Switch = Literal[SWITCH_VALUES]  # type: ignore[valid-type]  # "auto" | "on" | "off"
Method = Literal[METHODS]  # type: ignore[valid-type]
Priority = Literal["low", "normal", "high"]
Scheduler = Literal[SCHEDULERS]  # type: ignore[valid-type]
Checkpointing = Literal[CHECKPOINTING_VALUES]  # type: ignore[valid-type]  # "auto" | "on" | "off" | "selective"
Objective = Literal[objectives.names()]  # type: ignore[valid-type]  # "sft" | "dpo" | "grpo" (trainer.objectives)

MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
ALL_LINEAR = "all-linear"
TRACKING_SERVER = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""A tracking server's name in the box's list (``core.settings.TRACKING_SERVER_NAME``)."""
WANDB_NAME = r"^[^/\\#?%:\x00-\x1f]+$"
"""W&B project and entity names: W&B refuses ``/ \\ # ? % :`` in them."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LoraSpec(_Strict):
    """LoRA adapter shape; the update is scaled by ``alpha / r``."""

    r: Annotated[int, Field(ge=1, le=1024, description="LoRA rank (1-1024).")] = 16
    alpha: Annotated[int, Field(ge=1, le=4096, description="Scaling numerator (1-4096).")] = 16
    dropout: Annotated[float, Field(ge=0.0, lt=1.0, description="Dropout on the LoRA input, [0, 1).")] = 0.0
    target_modules: Annotated[
        list[str],
        Field(
            min_length=1,
            max_length=64,
            description='Module name suffixes to adapt (e.g. ["q_proj", "v_proj"]), or ["all-linear"].',
        ),
    ] = [ALL_LINEAR]

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, names: list[str]) -> list[str]:
        if ALL_LINEAR in names and len(names) > 1:
            raise ValueError('use ["all-linear"] alone, or list module names without it')
        for name in names:
            if name != ALL_LINEAR and not MODULE_NAME.match(name):
                raise ValueError(
                    f"{name!r} is not a module name; use names like 'q_proj' or 'self_attn.o_proj'"
                )
        if len(set(names)) != len(names):
            raise ValueError("remove the duplicate module names")
        return names


class Hyperparameters(_Strict):
    max_steps: Annotated[int | None, Field(ge=1, le=10_000_000, description="Optimizer steps to run.")] = None
    epochs: Annotated[
        float | None,
        Field(gt=0, le=1000, description="Passes over the data (fractions allowed); 1 when max_steps is unset."),
    ] = None
    learning_rate: Annotated[float, Field(gt=0, le=1.0, description="Peak AdamW learning rate.")] = 2e-4
    lr_scheduler: Annotated[Scheduler, Field(description="Decay after warm-up.")] = "cosine"
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000, description="Linear warm-up steps.")] = 0
    max_seq_len: Annotated[
        int,
        Field(ge=8, le=1_048_576, description="Samples are truncated to this; when only batch_tokens is set "
              "below it, it follows batch_tokens."),
    ] = 4096
    batch_tokens: Annotated[
        int,
        Field(ge=64, le=4_194_304, description="Packing budget: real tokens per packed micro-batch, >= "
              "max_seq_len; when only max_seq_len is set above it, it follows max_seq_len."),
    ] = 16384
    grad_accum: Annotated[int, Field(ge=1, le=1024, description="Micro-batches per optimizer step.")] = 1
    seed: Annotated[int, Field(ge=0, le=2**31 - 1, description="Seeds torch, Python and the data order.")] = 0
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0, description="AdamW decoupled weight decay.")] = 0.0
    max_grad_norm: Annotated[
        float, Field(ge=0.0, le=1e6, description="Clip the global gradient norm; 0 disables clipping.")
    ] = 1.0

    @model_validator(mode="before")
    @classmethod
    def _fill_linked_defaults(cls, raw: object) -> object:
        """One epoch when neither length is set; a packing budget and a truncation length of which
        only one is set move the other's default so the longest sample still fits in one batch
        (``batch_tokens: 2048`` alone trains with ``max_seq_len`` 2048, not a refusal)."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        if raw.get("max_steps") is None and raw.get("epochs") is None:
            raw["epochs"] = 1.0
        budget, length = raw.get("batch_tokens"), raw.get("max_seq_len")
        if isinstance(budget, int) and length is None and budget < cls.model_fields["max_seq_len"].default:
            raw["max_seq_len"] = budget
        if isinstance(length, int) and budget is None and length > cls.model_fields["batch_tokens"].default:
            raw["batch_tokens"] = length
        return raw

    # Cross-field rules sit on the field they refuse (fields validate in order, ``info.data`` holds
    # the earlier ones), so a 422 names ``hyperparameters.warmup_steps``, not ``hyperparameters``.
    @field_validator("epochs")
    @classmethod
    def _check_one_length(cls, epochs: float | None, info: ValidationInfo) -> float | None:
        if epochs is not None and info.data.get("max_steps") is not None:
            raise ValueError("set max_steps or epochs, not both (remove one of them)")
        return epochs

    @field_validator("warmup_steps")
    @classmethod
    def _check_warmup(cls, warmup: int, info: ValidationInfo) -> int:
        max_steps = info.data.get("max_steps")
        if max_steps is not None and warmup >= max_steps:
            raise ValueError(f"warmup_steps ({warmup}) must be < max_steps ({max_steps})")
        return warmup

    @field_validator("batch_tokens")
    @classmethod
    def _check_budget(cls, budget: int, info: ValidationInfo) -> int:
        length = info.data.get("max_seq_len")
        if length is not None and budget < length:
            raise ValueError(
                f"batch_tokens ({budget}) must be >= max_seq_len ({length}) so the longest sample fits in "
                "one packed batch; raise batch_tokens or lower max_seq_len"
            )
        return budget


class TrackingSpec(_Strict):
    """Where the worker mirrors the job's params and metrics (``worker/tracking``). Off unless set
    here or on the box (a default tracking server, ``FTQ_TENSORBOARD_DIR``, ``FTQ_WANDB_PROJECT``);
    a tracker that is down never fails or slows the job: it is a warning in the job's events. A
    tracker no live worker has the package for, and a server the box does not list
    (``FTQ_TRACKING_SERVERS``), are refused at submission (``core.jobs.trackers``). Credentials
    are the worker's, sent only to the server configured with them, never part of a spec."""

    mlflow: Annotated[
        bool | None, Field(description="Track on MLflow; null: when the box has a default MLflow server or "
                           "mlflow_server names one.")
    ] = None
    mlflow_server: Annotated[
        str | None,
        Field(min_length=1, max_length=64, pattern=TRACKING_SERVER,
              description="The MLflow server for this job, by its name in the box's list (FTQ_TRACKING_SERVERS; "
              "a name not on it is refused with the names that are); null: the box's default."),
    ] = None
    mlflow_tracking_uri: Annotated[
        str | None,
        Field(max_length=2048, pattern=r"^https?://\S+$",
              description="Older form of mlflow_server: accepted only when it is the URL of an MLflow server the "
              "box lists, and then means that server; any other URL is refused. Prefer mlflow_server."),
    ] = None
    mlflow_experiment: Annotated[
        str | None, Field(min_length=1, max_length=200, description="MLflow experiment; null: the box's (ftq).")
    ] = None
    tensorboard: Annotated[
        bool | None,
        Field(description="Write TensorBoard event files (the box's FTQ_TENSORBOARD_DIR/<job id>, else "
              "the job's tensorboard/ directory); null: when the box sets a directory."),
    ] = None
    wandb: Annotated[
        bool | None,
        Field(description="Track on Weights & Biases (the W&B server the job names, else the box's default, "
              "with the API key the operator configured for it); null: when wandb_server, wandb_project or "
              "the box's FTQ_WANDB_PROJECT names one."),
    ] = None
    wandb_server: Annotated[
        str | None,
        Field(min_length=1, max_length=64, pattern=TRACKING_SERVER,
              description="The W&B server for this job, by its name in the box's list (FTQ_TRACKING_SERVERS); "
              "null: the box's default."),
    ] = None
    wandb_project: Annotated[
        str | None,
        Field(min_length=1, max_length=128, pattern=WANDB_NAME,
              description="W&B project; null: the box's FTQ_WANDB_PROJECT, else ftq."),
    ] = None
    wandb_entity: Annotated[
        str | None,
        Field(min_length=1, max_length=128, pattern=WANDB_NAME,
              description="W&B team or user the run belongs to; null: the API key's default entity."),
    ] = None
    wandb_name: Annotated[
        str | None, Field(min_length=1, max_length=128, description="W&B run name; null: the job's name, else its id.")
    ] = None
    wandb_tags: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=64)]],
        Field(max_length=50, description="Tags on the W&B run (at most 50, each 1-64 characters)."),
    ] = []


def _section_spec(name: str, section: type) -> type[_Strict]:
    """An objective's settings as a spec model (``DpoSpec``): its dataclass' fields, defaults, docs and bounds."""
    hints = typing.get_type_hints(section)
    fields = {
        f.name: (hints[f.name], Field(default=f.default, description=f.metadata["doc"], **f.metadata.get("spec", {})))
        for f in dataclasses.fields(section)
    }
    title = "".join(part.title() for part in name.split("_"))
    return create_model(f"{title}Spec", __base__=_Strict, __doc__=section.__doc__, __module__=__name__, **fields)


SECTIONS: dict[str, type[_Strict]] = {name: _section_spec(name, cls) for name, cls in objectives.sections().items()}
"""Objective name -> its settings' model, the spec's field of that name (``trainer.objectives``)."""
DpoSpec = SECTIONS["dpo"]
GrpoSpec = SECTIONS["grpo"]


def _switch_fields() -> dict[str, Any]:
    docs = switch_docs()
    return {
        name: (Switch, Field(default="auto", title=docs[name][0], description=docs[name][1]))
        for name in SWITCHES
    }


OptimizationSwitches = create_model(
    "OptimizationSwitches",
    __base__=_Strict,
    __doc__="Per-optimization overrides; ``auto`` lets the trainer's hardware plan decide.",
    __module__=__name__,
    **_switch_fields(),
)
"""One field per ``trainer.config.SWITCHES``, each ``auto`` | ``on`` | ``off`` (default ``auto``)."""


def _check_objective(spec: JobSpec) -> None:
    """The objective runs on the spec's parallelism, and only its own section differs from the defaults."""
    declared = objectives.declaration(spec.objective)
    if not declared.fsdp2 and spec.method == "full" and spec.gpus > 1:  # FSDP2 would shard the model
        raise ValueError(f"objective {declared.name} with method full runs on one GPU (several GPUs would shard the "
                         f"model with FSDP2, which {declared.title} does not support yet); set gpus to 1 or use "
                         "method lora")
    for name, model in SECTIONS.items():
        if spec.objective != name and getattr(spec, name) != model():  # defaults are stored on every job
            raise ValueError(f"{name} settings apply to objective {name}; set objective to {name} or remove '{name}'")


class JobEval(_Strict):
    """An eval run on the base and on the tuned model once the job has succeeded (docs/evals.md)."""

    eval_id: Annotated[str, Field(min_length=1, max_length=64, description="The eval (eval_...).")]
    data_source: Annotated[dict[str, Any], Field(
        description="A run's data_source without its model: type completions, source (file_id or file_content), "
        "input_messages, sampling_params; or type lm_eval, source and task (an lm-eval task); checked at "
        "submission as a run of the base would be.")]
    at_checkpoints: Annotated[Literal["all"] | list[Annotated[int, Field(ge=1, le=10_000_000)]], Field(
        max_length=16, description="Also run it on checkpoints (job:<id>@<step>) once the job has succeeded: "
        "'all' (every checkpoint before the final one, at most 16) or a list of steps, each a multiple of "
        "checkpoint_every below max_steps. Default: none (base and tuned only). LoRA/QLoRA jobs only.")] = []

    @field_validator("at_checkpoints", mode="before")
    @classmethod
    def _check_steps(cls, value: Any) -> Any:
        """One message for a bad value (not one per branch of the union)."""
        steps_ok = isinstance(value, list) and all(type(s) is int and 1 <= s <= 10_000_000 for s in value)
        if value != "all" and not steps_ok:
            raise ValueError(f"'all' or a list of checkpoint steps (integers from 1), got {value!r}")
        return value


class JobSpec(_Strict):
    """The body of ``POST /v1/jobs``."""

    name: Annotated[str | None, Field(min_length=1, max_length=200, description="A label for people.")] = None
    project: Annotated[str | None, Field(
        min_length=1, max_length=64, exclude=True,
        description="The project (name) the job belongs to; you must be a member. Default: your key's or your "
        "own default project. Not stored in the spec: the job's ``project`` says it.")] = None
    model: Annotated[
        str,
        Field(
            min_length=1,
            max_length=512,
            description="Hub id (org/name) or a directory under FTQ_MODEL_ROOT holding config.json.",
        ),
    ]
    training_file: Annotated[str, Field(description="Id of an uploaded file with purpose=train.")]
    validation_file: Annotated[
        str | None, Field(description="Id of an uploaded file with purpose=validation.")
    ] = None
    method: Annotated[Method, Field(description="lora, full; qlora needs a CUDA worker with bitsandbytes.")] = "lora"
    lora: LoraSpec = LoraSpec()
    objective: Annotated[
        Objective,
        Field(
            description="; ".join(d.doc for d in objectives.declarations()) + ".",
            json_schema_extra={"x-titles": {d.name: d.title for d in objectives.declarations()}},
        ),
    ] = "sft"
    dpo: DpoSpec = DpoSpec()
    grpo: GrpoSpec = GrpoSpec()
    evals: Annotated[list[JobEval], Field(
        max_length=8, description="Evals run after training, on the base and on the tuned model (a run "
        "each), compared on the job's page and in its evals.")] = []
    hyperparameters: Hyperparameters = Hyperparameters()
    checkpoint_every: Annotated[
        int, Field(ge=0, le=10_000_000, description="Checkpoint every N steps; 0 keeps only the final one.")
    ] = 0
    optimizations: OptimizationSwitches = OptimizationSwitches()
    gradient_checkpointing: Annotated[
        Checkpointing,
        Field(
            description="Activation policy: auto (the trainer keeps every activation, checkpoints some "
            "layers, all layers, or offloads them, whichever fits the GPU's free memory), on (every layer), "
            "off (none), selective (as few layers as fit). true/false are read as on/off.",
        ),
    ] = "auto"
    max_gpu_memory_gb: Annotated[
        float | None,
        Field(
            gt=0,
            le=100_000,
            description="GiB of GPU memory the activation policy may plan for on each GPU (a GPU shared "
            "with others); unset plans for the memory free when the job starts.",
        ),
    ] = None
    priority: Annotated[
        Priority, Field(description="Queue order: high before normal before low, oldest first within each.")
    ] = "normal"
    gpus: Annotated[
        int,
        Field(
            ge=1,
            le=64,
            description="GPUs of one worker host the job runs on (one rank each, under torchrun); at most "
            "the largest live host's GPU count. Each optimizer step takes gpus x grad_accum packed "
            "micro-batches of batch_tokens.",
        ),
    ] = 1
    nodes: Annotated[
        int,
        Field(
            ge=1,
            le=64,
            description="Machines the job's GPUs are spread over (gpus / nodes on each, one torchrun per machine "
            "meeting through a c10d rendezvous); gpus must be a multiple of nodes. Above 1 with method full "
            "only on machines that share a checkpoint directory (FTQ_SHARED_DIR).",
        ),
    ] = 1
    pool: Annotated[
        str | None,
        Field(
            pattern=r"^[a-z][a-z0-9_-]{0,63}$",
            description="The named pool the job runs on: 'slurm' submits it to a Slurm cluster through the "
            "bridge serving that pool (docs/slurm.md; gpus and nodes within its partition); unset: ftq's own "
            "worker hosts.",
        ),
    ] = None
    tracking: TrackingSpec = TrackingSpec()
    max_non_finite_steps: Annotated[
        int,
        Field(ge=1, le=1000, description="Steps in a row with a NaN/inf loss or grad norm (each skipped, not "
              "applied) after which the job fails non_finite, keeping its last checkpoint."),
    ] = 3
    eval_every: Annotated[
        int,
        Field(ge=0, le=10_000_000, description="Validation loss every N steps and at the end; 0: at each "
              "checkpoint. Needs validation_file."),
    ] = 0
    sample_prompts: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=4000)]],
        Field(max_length=16, description="Prompts answered greedily at each checkpoint and at the end, "
              "shown on the job page."),
    ] = []
    sample_count: Annotated[
        int,
        Field(ge=0, le=16, description="Without sample_prompts: answer this many prompts of the validation set."),
    ] = 0
    sample_max_new_tokens: Annotated[
        int, Field(ge=1, le=1024, description="Longest sample generation (tokens).")
    ] = 48

    @field_validator("training_file", "validation_file")
    @classmethod
    def _check_file_id(cls, value: str | None) -> str | None:
        if value is not None and not FILE_ID.match(value):
            raise ValueError(
                f"{value!r} is not a file id; upload the dataset with POST /v1/files and use the "
                "returned id (file-<24 hex>)"
            )
        return value

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _read_boolean_checkpointing(cls, value: Any) -> Any:
        """Specs written when the field was a boolean: true is ``on``, false ``off``."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if value != value.strip() or "\x00" in value:
            raise ValueError("remove surrounding whitespace and control characters from the model name")
        return value

    @model_validator(mode="after")
    def _check_method(self) -> JobSpec:
        # The defaults pass: a stored spec (``to_stored``) names every field, lora included.
        if self.method == "full" and "lora" in self.model_fields_set and self.lora != LoraSpec():
            raise ValueError("lora settings apply to method lora or qlora; remove 'lora' for method full")
        _check_objective(self)
        if self.sample_count and not self.sample_prompts and self.validation_file is None:
            raise ValueError("sample_count takes prompts from the validation set: set validation_file, or "
                             "give sample_prompts")
        if self.validation_file is not None and self.validation_file == self.training_file:
            raise ValueError("validation_file must differ from training_file; upload a held-out set")
        return self

    @field_validator("nodes")
    @classmethod
    def _check_nodes(cls, nodes: int, info: ValidationInfo) -> int:
        gpus = info.data.get("gpus", 1)
        if gpus % nodes:
            raise ValueError(f"gpus ({gpus}) must be a multiple of nodes ({nodes}): each machine runs gpus / nodes "
                             "ranks; set gpus to a multiple of nodes")
        return nodes

    def to_stored(self) -> dict:
        """The spec as stored on the job: JSON, every default filled in."""
        return self.model_dump(mode="json")
