"""The trainer's configuration: what one training run needs, and nothing more.

Standard library only, so the worker (which has no torch) can build and write a
``TrainConfig`` as ``job.json`` and the trainer can read it back. The API's job spec
(pydantic, in ``core/``) is translated to this type in one worker function.

Every cross-field check raises ``ValueError`` naming the field and what to change. Objectives, the
record formats they train on and their settings' types come from their registry
(``trainer.objectives``, standard library too).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import objectives
from trainer.catalog import METHODS, SCHEDULERS
from trainer.objectives.declarations import DpoConfig
from trainer.objectives.grpo_config import GrpoConfig

SWITCH_VALUES = ("auto", "on", "off")
CHECKPOINTING_VALUES = ("auto", "on", "off", "selective")
"""``gradient_checkpointing``: the activation policy (``trainer.features.checkpointing.policy``)."""
DATA_FORMATS = ("auto", *objectives.formats())
"""``data.format``: ``auto`` or a format of the built-in objectives (``objectives.formats()`` counts later ones)."""
OBJECTIVES = objectives.names()
"""The built-in objectives (``objectives.names()`` counts any registered since)."""


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str
    """Hub id (resolved from the local HF cache only when offline) or a local directory."""
    dtype: str = "auto"
    """Weights dtype: ``auto`` (bf16 on a bf16-capable GPU, else float32), ``bfloat16``, ``float32``."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint. Off by default: it runs arbitrary code."""

    def __post_init__(self) -> None:
        if not self.name_or_path:
            raise ValueError("model.name_or_path: must name a hub id or a local directory")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"model.dtype: {self.dtype!r} is not one of auto, bfloat16, float16, float32")


@dataclass(frozen=True)
class LoraConfig:
    r: int = 16
    """LoRA rank."""
    alpha: int = 16
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module name suffixes to adapt, or ``("all-linear",)`` for every linear projection but the head."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"lora.r: must be >= 1, got {self.r}")
        if self.alpha < 1:
            raise ValueError(f"lora.alpha: must be >= 1, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules: name at least one module, or 'all-linear'")


@dataclass(frozen=True)
class DataConfig:
    train_path: str
    """JSONL training file (chat ``messages``, ``prompt``/``completion``, ``text`` or, for DPO,
    ``preference`` records: ``input.messages``, ``preferred_output``, ``non_preferred_output``)."""
    validation_path: str | None = None
    """Optional JSONL validation file, same formats."""
    format: str = "auto"
    """Record format; ``auto`` detects it from the first record."""
    max_seq_len: int = 4096
    """Samples longer than this are truncated to it."""
    batch_tokens: int = 16384
    """Packing budget: real (non-padding) tokens per packed micro-batch."""

    def __post_init__(self) -> None:
        formats = ("auto", *objectives.formats())
        if self.format not in formats:
            raise ValueError(f"data.format: {self.format!r} is not one of {', '.join(formats)}")
        if self.max_seq_len < 8:
            raise ValueError(f"data.max_seq_len: must be >= 8, got {self.max_seq_len}")
        if self.batch_tokens < self.max_seq_len:
            raise ValueError(
                f"data.batch_tokens ({self.batch_tokens}) must be >= data.max_seq_len "
                f"({self.max_seq_len}) so that the longest sample fits in one packed batch"
            )


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 2e-4
    """Peak learning rate of AdamW."""
    lr_scheduler: str = "cosine"
    """Decay after warm-up: ``cosine``, ``linear`` (both to 0 at the last step) or ``constant``."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    grad_accum: int = 1
    """Packed micro-batches per optimizer step."""
    max_steps: int | None = None
    """Optimizer steps to run; exactly one of max_steps and epochs is set."""
    epochs: float | None = None
    """Passes over the training set (fractions allowed); exactly one of max_steps and epochs is set."""

    def __post_init__(self) -> None:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("optim: set exactly one of max_steps and epochs")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"optim.max_steps: must be >= 1, got {self.max_steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"optim.epochs: must be > 0, got {self.epochs}")
        if not self.learning_rate > 0:
            raise ValueError(f"optim.learning_rate: must be > 0, got {self.learning_rate}")
        if self.lr_scheduler not in SCHEDULERS:
            raise ValueError(f"optim.lr_scheduler: {self.lr_scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if self.grad_accum < 1:
            raise ValueError(f"optim.grad_accum: must be >= 1, got {self.grad_accum}")
        if self.max_grad_norm < 0:
            raise ValueError(f"optim.max_grad_norm: must be >= 0, got {self.max_grad_norm}")


@dataclass(frozen=True)
class Optimizations:
    """Per-optimization switches, each ``auto`` (the plan decides), ``on`` or ``off``.

    The one list of switches: the job spec (``core.jobs.spec``), the plan
    (``trainer.plan.planner``) and the dashboard's form (through the API's schema) derive from
    these fields, their defaults, titles and descriptions (``switch_docs``).
    """

    packed_metadata_cache: str = field(
        default="auto",
        metadata={
            "title": "Packed-sequence metadata cache",
            "doc": "Build packed-batch boundary metadata once per batch and reuse it in every layer.",
        },
    )
    double_buffered_reload: str = field(
        default="auto",
        metadata={
            "title": "Double-buffered checkpoint reload",
            "doc": "Reload offloaded activation checkpoints into two alternating GPU buffers.",
        },
    )
    moe_grouped_routing: str = field(
        default="auto",
        metadata={
            "title": "MoE routing by argsort + bincount",
            "doc": "Group tokens by expert with one argsort + counts per MoE layer (no effect on dense models).",
        },
    )
    offload_activations: str = field(
        default="auto",
        metadata={
            "title": "Offloaded activation checkpoints",
            "doc": "Offload checkpointed layer inputs to pinned host memory "
            "(auto: when they would not fit on the GPU)."
        },
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value not in SWITCH_VALUES:
                raise ValueError(f"optimizations.{f.name}: {value!r} is not one of auto, on, off")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    output_dir: str
    """Where checkpoints (``checkpoints/step-NNNNNN``) and the final adapter (``adapter/``) go."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizations: Optimizations = field(default_factory=Optimizations)
    method: str = "lora"
    """``lora`` (bf16/fp32 base), ``qlora`` (4-bit base, needs bitsandbytes on CUDA) or ``full``."""
    objective: str = "sft"
    """A registered objective (``trainer.objectives``): ``sft`` (token cross-entropy), ``dpo``
    (preference pairs, ``data.format`` preference) or ``grpo`` (prompts, sampled and graded each step)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """The ``dpo`` objective's section (``trainer.objectives.declarations``): beta and label
    smoothing; read only when ``objective`` is ``dpo``. An objective's section is the field named
    after it."""
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """The ``grpo`` objective's section (``trainer.objectives.grpo_config``): the grader, the group,
    the sampling and the loss's variant; read only when ``objective`` is ``grpo``."""
    seed: int = 0
    """Seeds torch, Python and the data order."""
    checkpoint_every: int = 0
    """Write a resumable checkpoint every N optimizer steps; 0 writes only the final one."""
    gradient_checkpointing: str = "auto"
    """Activation policy: ``auto`` (the plan picks from the memory estimate: keep every activation,
    selective, full checkpointing, full + offload), ``on`` (full checkpointing), ``off`` (keep
    every activation), ``selective`` (checkpoint as few layers as fit). Old booleans still read:
    true is ``on``, false ``off``."""
    max_gpu_memory_gb: float | None = None
    """Cap on the GPU memory the activation policy plans for (GiB), on a GPU shared with others;
    None plans for the GPU's free memory at start."""
    resume: bool = True
    """Resume from the newest checkpoint (``checkpoint_home``) when one exists."""
    shared_checkpoint_dir: str | None = None
    """An absolute directory that every machine of the run sees at this same path (a pool's
    shared storage): every rank writes its checkpoint shards under ``<it>/checkpoints/`` and
    resumes from there, so a sharded run (method ``full``, FSDP2) may span machines. None: the
    checkpoints go under ``output_dir``, on this machine's disk."""
    device: str = "auto"
    """``auto`` (CUDA if present, else CPU), ``cpu`` or ``cuda``."""
    job_id: str | None = None
    """The job this run belongs to, echoed in events; None when run by hand."""
    max_non_finite_steps: int = 3
    """Steps in a row whose loss or grad norm is NaN/inf (each one not applied) after which the
    run fails ``non_finite``; the last checkpoint stays (``trainer.training.guards``)."""
    eval_every: int = 0
    """Validation loss every N optimizer steps (and at the end); 0: at each checkpoint."""
    sample_prompts: tuple[str, ...] = ()
    """Prompts to answer greedily at each checkpoint and at the end (``trainer.generate.samples``)."""
    sample_count: int = 0
    """With no ``sample_prompts``: take this many prompts from the validation set."""
    sample_max_new_tokens: int = 48
    """Longest greedy generation per prompt (tokens)."""
    gpus: int = 1
    """Ranks the job's global batch is defined over: each optimizer step trains
    ``gpus x optim.grad_accum`` packed micro-batches, whatever number of ranks runs it (a job
    resumed on fewer ranks accumulates more micro-batches per rank)."""

    @property
    def checkpoint_home(self) -> str:
        """The directory whose ``checkpoints/`` holds the run's checkpoints: the shared one if set."""
        return self.shared_checkpoint_dir or self.output_dir

    @property
    def global_micro_batches(self) -> int:
        """Packed micro-batches per optimizer step, over all ranks."""
        return self.gpus * self.optim.grad_accum

    def __post_init__(self) -> None:
        if isinstance(self.gradient_checkpointing, bool):  # job.json files from before the policy
            object.__setattr__(self, "gradient_checkpointing", "on" if self.gradient_checkpointing else "off")
        if self.gradient_checkpointing not in CHECKPOINTING_VALUES:
            raise ValueError(
                f"gradient_checkpointing: {self.gradient_checkpointing!r} is not one of "
                f"{', '.join(CHECKPOINTING_VALUES)}"
            )
        cap = self.max_gpu_memory_gb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"max_gpu_memory_gb: must be a number of GiB > 0 (or null for no cap), got {cap!r}")
        if self.method not in METHODS:
            raise ValueError(f"method: {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.gpus <= 1024:
            raise ValueError(f"gpus: must be between 1 and 1024, got {self.gpus}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: must be >= 0, got {self.checkpoint_every}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} is not one of auto, cpu, cuda")
        shared = self.shared_checkpoint_dir
        if shared is not None and (not isinstance(shared, str) or not Path(shared).is_absolute()):
            raise ValueError(f"shared_checkpoint_dir: must be an absolute path (the same on every machine), got {shared!r}")
        _check_guards(self)
        _check_objective(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        """Build from the JSON shape written by ``to_dict``; unknown keys are an error."""
        nested = {
            "model": ModelConfig,
            "data": DataConfig,
            "optim": OptimConfig,
            "lora": LoraConfig,
            "optimizations": Optimizations,
            **objectives.sections(),
        }
        if "offload_activations" in raw:  # job.json files written before it joined optimizations
            raw = dict(raw)
            legacy = raw.pop("offload_activations")
            opts = dict(raw.get("optimizations") or {})
            if opts.setdefault("offload_activations", legacy) != legacy:
                raise ValueError(
                    "offload_activations: set it once, under optimizations "
                    f"(top level says {legacy!r}, optimizations says {opts['offload_activations']!r})"
                )
            raw["optimizations"] = opts
        _reject_unknown(cls, raw, "")
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            sub = nested.get(key)
            if sub is not None:
                if not isinstance(value, dict):
                    raise ValueError(f"{key}: expected an object, got {type(value).__name__}")
                _reject_unknown(sub, value, key + ".")
                if sub is LoraConfig and "target_modules" in value:
                    value = {**value, "target_modules": tuple(value["target_modules"])}
                kwargs[key] = sub(**value)
            elif key == "sample_prompts":
                kwargs[key] = tuple(value)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["lora"]["target_modules"] = list(self.lora.target_modules)
        return raw

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))


SWITCHES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Optimizations))
"""Every optimization switch, in the order the plan decides and the form shows them."""


def switch_docs() -> dict[str, tuple[str, str]]:
    """Switch name -> (title, one-line description), for the job spec's schema and the form."""
    return {f.name: (f.metadata["title"], f.metadata["doc"]) for f in dataclasses.fields(Optimizations)}


def _check_guards(config: TrainConfig) -> None:
    """The guard, evaluation and sample fields' ranges (``TrainConfig.__post_init__``)."""
    if config.max_non_finite_steps < 1:
        raise ValueError(f"max_non_finite_steps: must be >= 1, got {config.max_non_finite_steps}")
    if config.eval_every < 0:
        raise ValueError(f"eval_every: must be >= 0, got {config.eval_every}")
    if config.sample_count < 0:
        raise ValueError(f"sample_count: must be >= 0, got {config.sample_count}")
    if config.sample_max_new_tokens < 1:
        raise ValueError(f"sample_max_new_tokens: must be >= 1, got {config.sample_max_new_tokens}")
    if config.sample_count and not config.sample_prompts and not config.data.validation_path:
        raise ValueError("sample_count: prompts are taken from the validation set; set data.validation_path "
                         "or give sample_prompts")


def _check_objective(config: TrainConfig) -> None:
    """``objective`` is registered and ``data.format`` is one of its formats (or ``auto``)."""
    declaration = objectives.declaration(config.objective)  # raises naming the field and the choices
    fmt = config.data.format
    if fmt != "auto" and fmt not in declaration.formats:
        owners = [d.title for d in objectives.declarations() if fmt in d.formats]
        raise ValueError(
            f"data.format: {fmt!r} records cannot train objective {config.objective!r}; "
            f"{declaration.title} trains on {', '.join(declaration.formats)} records, {fmt} records train "
            f"{' or '.join(owners)}"
        )


def _reject_unknown(cls: type, raw: dict[str, Any], prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
