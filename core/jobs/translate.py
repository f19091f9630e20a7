"""The one mapping from the API's job spec to the trainer's ``TrainConfig``.

The worker calls it to write ``job.json``; the API calls it at submission to prove the spec
translates, so a combination the trainer would refuse is a 4xx, not a failed job.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.errors import InvalidInput
from core.jobs.spec import Hyperparameters, JobSpec
from trainer import objectives
from trainer.config import (
    DataConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    Optimizations,
    TrainConfig,
)


def to_train_config(
    spec: JobSpec,
    *,
    job_id: str,
    files: Mapping[str, str | Path],
    output_dir: str | Path,
    model_path: str,
) -> TrainConfig:
    """Build the trainer's config for ``spec``.

    Args:
        spec: the validated job spec.
        job_id: echoed in the trainer's events.
        files: file id -> path of the stored dataset, for ``training_file`` and
            ``validation_file`` (``core.files.service.paths_for`` builds it).
        output_dir: the job's directory for checkpoints and the final adapter.
        model_path: what the trainer loads: the absolute local directory or the hub id
            (``core.jobs.model_source.resolve_model(...).name_or_path``).

    Raises:
        InvalidInput: a file id is missing from ``files``, or the trainer's config refuses
            the combination (its message names the field).
    """
    hp = spec.hyperparameters
    try:
        train_path = str(files[spec.training_file])
        validation_path = str(files[spec.validation_file]) if spec.validation_file else None
    except KeyError as exc:
        raise InvalidInput(f"no stored path for file {exc.args[0]}", param="training_file") from exc
    try:
        return TrainConfig(
            model=ModelConfig(name_or_path=model_path),
            data=DataConfig(train_path, validation_path, max_seq_len=hp.max_seq_len, batch_tokens=hp.batch_tokens),
            optim=_optim_config(hp),
            lora=LoraConfig(
                r=spec.lora.r,
                alpha=spec.lora.alpha,
                dropout=spec.lora.dropout,
                target_modules=tuple(spec.lora.target_modules),
            ),
            optimizations=Optimizations(**spec.optimizations.model_dump()),
            method=spec.method,
            objective=spec.objective,
            **_objective_sections(spec),
            seed=hp.seed,
            gpus=spec.gpus,
            checkpoint_every=spec.checkpoint_every,
            gradient_checkpointing=spec.gradient_checkpointing,
            max_gpu_memory_gb=spec.max_gpu_memory_gb,
            max_non_finite_steps=spec.max_non_finite_steps,
            eval_every=spec.eval_every,
            sample_prompts=tuple(spec.sample_prompts),
            sample_count=spec.sample_count,
            sample_max_new_tokens=spec.sample_max_new_tokens,
            output_dir=str(output_dir),
            job_id=job_id,
        )
    except ValueError as exc:
        raise InvalidInput(f"the trainer refuses this spec: {exc}") from exc


def _optim_config(hp: Hyperparameters) -> OptimConfig:
    return OptimConfig(
        learning_rate=hp.learning_rate,
        lr_scheduler=hp.lr_scheduler,
        warmup_steps=hp.warmup_steps,
        weight_decay=hp.weight_decay,
        max_grad_norm=hp.max_grad_norm,
        grad_accum=hp.grad_accum,
        max_steps=hp.max_steps,
        epochs=hp.epochs,
    )


def _objective_sections(spec: JobSpec) -> dict[str, Any]:
    """Each objective's settings (``trainer.objectives``' sections, e.g. ``dpo``) from the spec's
    field of the same name; every one is translated, as the spec stores every one."""
    return {name: section(**getattr(spec, name).model_dump()) for name, section in objectives.sections().items()}
