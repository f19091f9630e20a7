"""When the run measures itself, and the events it writes: ``eval`` loss and ``sample`` generations.

- Validation loss (``eval`` event): every ``eval_every`` steps, or at each checkpoint when
  ``eval_every`` is 0, and always after the last step. Needs a validation set.
- Greedy generations (``sample`` event, ``trainer.generate.samples``): at each checkpoint and after the
  last step, when the job names ``sample_prompts`` or a ``sample_count``.

Neither runs on a step the run is stopping at (cancel): the user asked it to end.
Both are read on the host: their step's event is flushed first (``trainer.training.train``), so the
step-late reading of step results is unchanged between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.config import TrainConfig
from trainer.data.dataset import Sample
from trainer.generate.samples import Sampler
from trainer.training.step import StepContext, evaluate


def is_eval_due(config: TrainConfig, step: int, *, checkpointing: bool, is_last: bool) -> bool:
    """Whether validation loss is measured after ``step``."""
    if is_last:
        return True
    if config.eval_every:
        return step % config.eval_every == 0
    return checkpointing


def measure(
    ctx: StepContext,
    config: TrainConfig,
    step: int,
    emit: Callable[..., Any],
    *,
    validation: list[Sample] | None,
    sampler: Sampler | None,
    eval_loss: bool,
    samples: bool,
    final: bool,
) -> None:
    """Emit the ``eval`` event (if ``eval_loss`` and a validation set) and the ``sample`` event
    (if ``samples`` and a sampler) for the weights after ``step``."""
    if eval_loss and validation is not None:
        loss, targets, accuracy = evaluate(ctx, validation, config.data.batch_tokens)
        emit("eval", step=step, loss=loss, tokens=targets, accuracy=accuracy)
    if samples and sampler is not None:
        generated = sampler.generate(ctx.model, ctx.device, ctx.autocast, ctx.comm)
        emit("sample", step=step, final=final, samples=generated)
