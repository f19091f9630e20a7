"""The non-finite guard: a step whose loss or gradient norm is NaN or inf is never applied.

Two halves, so the guard adds no host sync to a step:

1. ``arm`` (on the device, before ``optimizer.step()``): ``found_inf = !isfinite(loss) |
   !isfinite(grad_norm)`` is computed on the device and handed to the optimizer the way
   ``torch.amp.GradScaler`` does it (``optimizer.found_inf``). The fused AdamW the trainer
   builds (``fused=True`` on CUDA) reads that flag inside its kernel: when it is set, no
   parameter, moment or step count changes (``torch.optim.adam._fused_adam``). Nothing is read
   back, so the step stays as asynchronous as before. A non-fused optimizer (the CPU path, where
   ``trainer.training.train`` builds the foreach AdamW) cannot take the flag; there the flag is read on
   the host, which on a CPU tensor waits for nothing (the value is already computed).
   Under FSDP2 the flag is a 0-dim tensor, which DTensor replicates implicitly.
   The learning-rate schedule still advances on a skipped step, as with GradScaler: the
   schedule is a function of the step index, known before the step, and replays on resume.
2. ``NonFiniteGuard.check`` (on the host, one step late): the step's loss and grad norm are read
   anyway for its ``step`` event (``trainer.training.step.PendingStep``); a non-finite one emits a ``skip``
   event, and ``max_non_finite_steps`` such steps in a row end the run with ``NonFiniteError``
   (code ``non_finite``), naming the first bad step of the streak. The run writes no checkpoint
   on the way out, so the newest one on disk holds weights that never saw a non-finite update
   and the job can be resumed from it with other settings.

Alternatives not taken: zeroing the gradients still moves the weights (weight decay, momentum);
reading the flag before every step would add a host sync per step on the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import TrainerError


class NonFiniteError(TrainerError):
    """Too many non-finite steps in a row; the message names the first one and the fix."""

    code = "non_finite"


def arm(optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Make ``optimizer.step()`` a no-op if this step's loss or grad norm is not finite.

    Returns:
        True: call ``optimizer.step()`` (a fused optimizer skips by itself when the device flag
        is set); False: the step is non-finite and the caller must not call it (non-fused path).
    """
    found_inf = torch.logical_not(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm.detach()))
    found_inf = found_inf.to(torch.float32).reshape(())
    if _takes_found_inf(optimizer):
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # read by the fused kernel
        return True
    return not bool(found_inf.item())  # a CPU tensor here: the value is already there


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours ``optimizer.found_inf`` (Adam/AdamW/SGD with fused=True)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups
    )


@dataclass
class NonFiniteGuard:
    """Counts non-finite steps in a row as their values are read (one step late)."""

    limit: int
    """``TrainConfig.max_non_finite_steps``."""
    streak: int = 0
    first_step: int | None = None
    """The first step of the current streak (None while the last step was finite)."""
    skipped: int = 0
    """Non-finite steps of this run so far."""

    def check(self, event: dict[str, Any], emit: Callable[..., Any], last_checkpoint_step: int) -> None:
        """After a ``step`` event: a ``skip`` event if it was not finite; raise at the limit.

        Raises:
            NonFiniteError: ``limit`` steps in a row were not finite.
        """
        loss, grad_norm = event.get("loss"), event.get("grad_norm")
        if _finite(loss) and _finite(grad_norm):
            self.streak, self.first_step = 0, None
            return
        step = int(event["step"])
        self.streak += 1
        self.skipped += 1
        self.first_step = step if self.first_step is None else self.first_step
        emit("skip", step=step, loss=loss, grad_norm=grad_norm, consecutive=self.streak,
             limit=self.limit, first_step=self.first_step)
        if self.streak >= self.limit:
            raise NonFiniteError(self._message(step, loss, grad_norm, last_checkpoint_step))

    def _message(self, step: int, loss: Any, grad_norm: Any, last_checkpoint_step: int) -> str:
        kept = (
            f"the last checkpoint (step {last_checkpoint_step}) holds the last good weights; resume "
            "from it"
            if last_checkpoint_step > 0
            else "no checkpoint was written before it; submit again"
        )
        return (
            f"step {self.first_step}: loss {loss} / grad norm {grad_norm} not finite, and so were the "
            f"{self.streak - 1} steps after it up to step {step} (max_non_finite_steps={self.limit}); none "
            f"of them was applied. {kept} with a lower learning_rate, max_grad_norm > 0 or float32 weights, "
            "and check the data of those steps"
        )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
