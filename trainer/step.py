"""One optimizer step, the validation pass and the learning-rate schedule.

``train_step`` queues a step over its packed micro-batches and returns it unread: every
micro-batch's loss is its token-loss sum divided by the label count of the whole step (a host int
from the packer), so the accumulated gradient is the step's mean exactly. Nothing here reads a
device value back: the loss and the grad norm stay on the device, and ``PendingStep.read`` turns
them into the ``step`` event one step late (``trainer.metrics``), when they are long done.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer import metrics
from trainer.dataset import Sample
from trainer.events import StepEvent
from trainer.install import Installation
from trainer.packing import MicroBatchRef, pack_batch, pack_indices


@dataclass(frozen=True)
class StepContext:
    """What every step of a run uses; built once by ``trainer.train``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    samples: list[Sample]
    installed: Installation
    device: torch.device
    autocast: Any
    """``torch.autocast`` in the plan's dtype on CUDA, else a null context."""
    flops: metrics.FlopCounter
    max_grad_norm: float
    """Clip the global gradient norm to this; 0 means no clipping."""


@dataclass
class PendingStep:
    """A queued step whose device-side results are read only when the next step is queued."""

    step: int
    epoch: float
    loss: torch.Tensor
    """The step's mean token loss (a device scalar, read one step late)."""
    grad_norm: torch.Tensor
    lr: float
    tokens: int
    sequences: int
    flops: float
    timing: metrics.PendingTiming
    memory: dict[str, int | None]

    def read(self, total_steps: int, peak_flops: float | None) -> StepEvent:
        times = self.timing.read()
        seconds = times["step_ms"] / 1000.0
        return StepEvent(
            step=self.step,
            total_steps=total_steps,
            epoch=round(self.epoch, 4),
            loss=self.loss.item(),
            lr=self.lr,
            grad_norm=self.grad_norm.item(),
            tokens=self.tokens,
            sequences=self.sequences,
            **times,
            tokens_per_s=self.tokens / seconds if seconds > 0 else None,
            mfu=metrics.mfu(self.flops, times["step_ms"], peak_flops),
            **self.memory,
        )

    def event(self, total_steps: int, peak_flops: float | None) -> dict[str, Any]:
        """The ``step`` event's fields."""
        return dataclasses.asdict(self.read(total_steps, peak_flops))


def train_step(ctx: StepContext, step: int, refs: list[MicroBatchRef]) -> PendingStep:
    """Queue one optimizer step over the micro-batches ``refs``; returns it unread."""
    timer = metrics.StepTimer(ctx.device)
    metrics.reset_peak_memory(ctx.device)
    batches = [pack_batch([ctx.samples[i] for i in ref.sample_indices]) for ref in refs]
    step_targets = sum(b.num_targets for b in batches)
    total_loss = torch.zeros((), device=ctx.device)
    lengths: list[int] = []
    for host_batch in batches:
        with timer.phase("data"):
            batch, meta = ctx.installed.micro_batch(host_batch, ctx.device)
        with timer.phase("forward"), ctx.autocast:
            loss = ctx.installed.loss(ctx.model, batch, meta, step_targets)
        with timer.phase("backward"):
            loss.backward()
        total_loss += loss.detach()
        lengths.extend(batch.lengths)
    with timer.phase("optimizer"):
        grad_norm, lr = _optimizer_step(ctx)
    return PendingStep(
        step=step,
        epoch=refs[-1].epoch,
        loss=total_loss,
        grad_norm=grad_norm,
        lr=lr,
        tokens=sum(lengths),
        sequences=len(lengths),
        flops=ctx.flops.step_flops(lengths),
        timing=timer.finish(),
        memory=metrics.memory_stats(ctx.device),
    )


def _optimizer_step(ctx: StepContext) -> tuple[torch.Tensor, float]:
    """Clip, step, schedule, zero; returns the (device) grad norm and the lr the step used."""
    params = [p for group in ctx.optimizer.param_groups for p in group["params"]]
    max_norm = ctx.max_grad_norm if ctx.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
    lr = ctx.scheduler.get_last_lr()[0]
    ctx.optimizer.step()
    ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def evaluate(ctx: StepContext, samples: list[Sample], batch_tokens: int) -> tuple[float, int]:
    """Token-weighted validation loss over ``samples`` and its target count."""
    model = ctx.model
    model.eval()
    total, targets = 0.0, 0
    try:
        with torch.no_grad():
            for indices in pack_indices([len(s) for s in samples], range(len(samples)), batch_tokens):
                batch, meta = ctx.installed.micro_batch(pack_batch([samples[i] for i in indices]), ctx.device)
                with ctx.autocast:
                    total += ctx.installed.loss(model, batch, meta, 1).item()
                targets += batch.num_targets
    finally:
        model.train()
    return total / max(targets, 1), targets


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """LR factor for the update with 0-based index i: linear warm-up to 1 over ``warmup`` updates
    (the first update already moves: (i + 1) / warmup), then ``kind`` decay reaching 0 at ``total``."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (i - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
