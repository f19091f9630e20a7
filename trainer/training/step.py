"""One optimizer step, the validation pass and the learning-rate schedule.

``train_step`` queues a step over this rank's share of its packed micro-batches and returns it
unread: every micro-batch's loss is its token-loss sum divided by the label count of the whole
global step (a host int every rank computes from the lengths), so the accumulated gradient is the
step's mean exactly, on one rank or several (``trainer.parallel.distributed``). Nothing here reads a device
value back: the loss (summed over ranks by an all-reduce queued on the stream) and the grad norm
stay on the device, and ``PendingStep.read`` turns them into the ``step`` event one step late
(``trainer.training.metrics``), when they are long done; per-rank timings and memory are host values,
gathered over the gloo group (the job's memory is the largest rank's, its allocator retries the
sum: a retry on one rank stalls the step of all). The run's objective (``trainer.objectives``)
packs the micro-batches, adds its statistics to a device vector around each forward, and turns
the step's sums (copied with the loss, in the same transfer) into its step fields; nothing here
knows which one it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.training import guards, metrics
from trainer.data.dataset import Sample
from trainer.parallel.distributed import Comm, share
from trainer.events import StepEvent
from trainer.training.install import Installation
from trainer.objectives.base import Objective
from trainer.objectives.sft import Sft
from trainer.data.packing import MicroBatchRef, pack_indices
from trainer.parallel.strategy import Parallel

_RANK_FIELDS = (
    "step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms",
    "tokens", "gpu_mem_allocated", "gpu_mem_reserved", "gpu_mem_peak", "gpu_alloc_retries", "host_rss",
)
"""What each rank reports of a step (``StepEvent.ranks``); -1 stands for None on the wire."""


@dataclass(frozen=True)
class StepContext:
    """What every step of a run uses; built once by ``trainer.training.train``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    samples: list[Any]
    """The run's schedule items (``Objective.load_data``)."""
    installed: Installation
    device: torch.device
    autocast: Any
    """``torch.autocast`` in the plan's dtype on CUDA, else a null context."""
    flops: metrics.FlopCounter
    max_grad_norm: float
    """Clip the global gradient norm to this; 0 means no clipping."""
    parallel: Parallel
    """The loss module as the run's strategy wraps it (none, DDP or FSDP2)."""
    comm: Comm
    """This rank's process groups (a no-op twin for one rank)."""
    objective: Objective = field(default_factory=Sft)
    """The run's objective (``trainer.objectives.load``); callers that only evaluate may leave the default."""


@dataclass
class PendingStep:
    """A queued step whose device-side results are read only when the next step is queued."""

    step: int
    epoch: float
    loss: torch.Tensor
    """The step's mean token loss over all ranks (a device scalar, read one step late)."""
    grad_norm: torch.Tensor
    lr: float
    tokens: int
    """Real tokens of the whole step (all ranks)."""
    sequences: int
    rank_tokens: int
    """Real tokens this rank trained on."""
    flops: float
    """Model FLOPs of the whole step (all ranks)."""
    timing: metrics.PendingTiming
    memory: dict[str, int | None]
    objective: Objective
    stats: torch.Tensor
    """The objective's statistics summed over the step's micro-batches and all ranks (device, read
    with the loss in one transfer, one step late)."""
    targets: int = 0
    """The step's loss denominator (all ranks): target tokens, or DPO's pairs."""
    host: _HostCopy | None = None
    """The device results' pinned host copies, swapped in by ``read`` once the step is done."""

    def read(self, total_steps: int, peak_flops: float | None, comm: Comm) -> StepEvent:
        """The step's event; a collective over the ranks (every rank calls it, rank 0 emits it)."""
        mine = {**self.timing.read(), "tokens": self.rank_tokens, **self.memory}  # waits for the step's end
        if self.host is not None:
            self.host.apply(self)
        gathered = comm.gather_host([_wire(mine[f]) for f in _RANK_FIELDS], "step metrics")
        ranks = [{"rank": r, **{f: _unwire(v, f) for f, v in zip(_RANK_FIELDS, row)}} for r, row in enumerate(gathered)]
        slowest = max(ranks, key=lambda r: r["step_ms"])
        seconds = slowest["step_ms"] / 1000.0
        world = len(ranks)
        loss, sums = self._loss_and_sums()
        return StepEvent(
            step=self.step,
            total_steps=total_steps,
            epoch=round(self.epoch, 4),
            loss=loss,
            lr=self.lr,
            grad_norm=self.grad_norm.item(),
            tokens=self.tokens,
            sequences=self.sequences,
            **{f: slowest[f] for f in ("step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms")},
            tokens_per_s=self.tokens / seconds if seconds > 0 else None,
            mfu=metrics.mfu(self.flops / world, slowest["step_ms"], peak_flops),
            **{f: _largest(ranks, f) for f in ("gpu_mem_allocated", "gpu_mem_reserved", "gpu_mem_peak", "host_rss")},
            gpu_alloc_retries=_summed(ranks, "gpu_alloc_retries"),  # a retry on any rank stalls every rank
            ranks=ranks if world > 1 else None,
            metrics=self.objective.step_fields(sums, self.targets),
        )

    def _loss_and_sums(self) -> tuple[float, list[float]]:
        """The loss and the objective's sums, read in one device-to-host transfer."""
        loss, *sums = torch.cat([self.loss.float().reshape(1), self.stats.reshape(-1)]).tolist()
        return loss, sums

    def event(self, total_steps: int, peak_flops: float | None, comm: Comm) -> dict[str, Any]:
        """The ``step`` event's fields (a collective, see ``read``)."""
        return self.read(total_steps, peak_flops, comm).fields()


def _wire(value: float | int | None) -> float:
    return -1.0 if value is None else float(value)


def _unwire(value: float, field: str) -> float | int | None:
    if value < 0:
        return None
    return value if field.endswith("_ms") else int(value)


def _largest(ranks: list[dict[str, Any]], field: str) -> int | None:
    values = [r[field] for r in ranks if r[field] is not None]
    return max(values) if values else None


def _summed(ranks: list[dict[str, Any]], field: str) -> int | None:
    values = [r[field] for r in ranks if r[field] is not None]
    return sum(values) if values else None


def train_step(ctx: StepContext, step: int, refs: list[MicroBatchRef]) -> PendingStep:
    """Queue one optimizer step: this rank's share of the micro-batches ``refs``; returns it unread."""
    timer = metrics.StepTimer(ctx.device)
    retries_at_start = metrics.reset_peak_memory(ctx.device)
    lengths = [[len(ctx.samples[i]) for i in ref.sample_indices] for ref in refs]
    step_targets = sum(ctx.samples[i].num_loss_tokens for ref in refs for i in ref.sample_indices)
    world = ctx.comm.world
    parts = share([sum(n) for n in lengths], world.world_size)
    mine = parts[world.rank]
    total_loss = torch.zeros((), device=ctx.device)
    objective = ctx.objective
    stats = objective.new_stats(ctx.device)
    todo = _padded(mine, parts, ctx.parallel.strategy)
    _rollout(ctx, timer, step, [ctx.samples[i] for j in mine for i in refs[j].sample_indices])
    try:
        for k, j in enumerate(todo):
            host_batch = objective.pack([ctx.samples[i] for i in refs[j].sample_indices])
            with timer.phase("data"):
                batch, meta = ctx.installed.micro_batch(host_batch, ctx.device)
            with ctx.parallel.sync(last=k == len(todo) - 1):
                with timer.phase("forward"), ctx.autocast, objective.collecting(stats if k < len(mine) else None):
                    loss = ctx.parallel.loss(batch, meta, step_targets)
                    if k >= len(mine):  # a stand-in: it pairs the collectives, it trains nothing
                        loss = loss * 0.0
                with timer.phase("backward"):
                    # DDP and FSDP average gradients over ranks: scaled by W, the average is the sum.
                    (loss * world.world_size if world.is_distributed else loss).backward()
            total_loss += loss.detach()
    except torch.OutOfMemoryError as exc:
        if not ctx.parallel.agreeing:
            raise
        ctx.parallel.agree(exc, ctx.comm)  # raises on every rank
    # an agreeing step raises on every rank if another ran out; else the gradients are exchanged
    ctx.parallel.end_backward(ctx.comm)
    ctx.comm.all_reduce_sum(total_loss)
    if stats.numel():
        ctx.comm.all_reduce_sum(stats)
    with timer.phase("optimizer"):
        grad_norm, lr = _optimizer_step(ctx, total_loss)
        # queued before the phase's end event, which ``PendingStep.read`` waits for
        host = _HostCopy.stage(ctx.device, loss=total_loss, grad_norm=grad_norm, stats=stats)
    every = [n for row in lengths for n in row]
    tokens, rank_tokens = _trained_tokens(ctx, lengths, mine)
    return PendingStep(
        step=step,
        epoch=refs[-1].epoch,
        loss=total_loss,
        grad_norm=grad_norm,
        lr=lr,
        tokens=tokens,
        sequences=len(every),
        rank_tokens=rank_tokens,
        flops=objective.step_flops(ctx.flops, [ctx.samples[i] for r in refs for i in r.sample_indices]),
        timing=timer.finish(),
        memory=metrics.memory_stats(ctx.device, retries_at_start),
        objective=objective,
        stats=stats,
        targets=step_targets,
        host=host,
    )


def _rollout(ctx: StepContext, timer: metrics.StepTimer, step: int, items: list[Any]) -> None:
    """An objective that samples its step's data from the policy (GRPO's ``rollout``) does it now,
    on this rank's ``items``; the others have no ``rollout``."""
    rollout = getattr(ctx.objective, "rollout", None)
    if rollout is not None:
        with timer.phase("data"):
            rollout(ctx.comm, ctx.model, step, items, forward=ctx.parallel.model_forward,
                    cache_dtype=ctx.parallel.gathered_dtype)


def _trained_tokens(ctx: StepContext, lengths: list[list[int]], mine: list[int]) -> tuple[int, int]:
    """The step's real tokens over every rank and this rank's: the schedule items' lengths, or, for
    an objective that samples its step's data (GRPO's ``sampled_tokens``: an item's length is what
    the schedule packs it by, not what was sampled), what this rank trained on, summed over the
    ranks (a host gather every rank reaches once a step)."""
    sampled = getattr(ctx.objective, "sampled_tokens", None)
    if sampled is None:
        return sum(n for row in lengths for n in row), sum(sum(lengths[j]) for j in mine)
    rank = int(sampled())
    return int(sum(row[0] for row in ctx.comm.gather_host([float(rank)], "rank index"))), rank


class _HostCopy:
    """The step's device results (loss, grad norm, the objective's sums) copied to pinned host
    memory as the step's last queued work, so reading them one step late waits only for that
    step: a plain ``.item()`` would be a blocking copy queued behind the NEXT step's work, the host
    idle until the GPU drained it and the GPU idle while the host then queued the step after (a
    bubble every step; ~3% of an 8B step on an H200). On the CPU the tensors are read as they are.
    """

    def __init__(self, staged: torch.Tensor | None, parts: dict[str, tuple[int, int, torch.Size]]) -> None:
        self._staged, self._parts = staged, parts

    @classmethod
    def stage(cls, device: torch.device, **tensors: torch.Tensor | None) -> _HostCopy:
        present = {name: t for name, t in tensors.items() if t is not None and t.numel()}
        if device.type != "cuda" or not present:
            return cls(None, {})
        flat = torch.cat([t.detach().reshape(-1).float() for t in present.values()])
        staged = torch.empty(flat.shape, dtype=torch.float32, pin_memory=True)
        staged.copy_(flat, non_blocking=True)
        parts, at = {}, 0
        for name, t in present.items():
            parts[name] = (at, at + t.numel(), t.shape)
            at += t.numel()
        return cls(staged, parts)

    def apply(self, pending: PendingStep) -> None:
        """Swap ``pending``'s device tensors for their host copies (after the step's end event)."""
        for name, (lo, hi, shape) in self._parts.items():
            setattr(pending, name, self._staged[lo:hi].reshape(shape))
        self._parts = {}


def _padded(mine: list[int], parts: list[list[int]], strategy: str | None) -> list[int]:
    """This rank's micro-batches, plus stand-ins (the step's first) where the collectives need them.

    DDP exchanges once per rank and step (its last backward), so only a rank with nothing to
    train runs a stand-in. Under FSDP2 every forward gathers parameters with all ranks, so every
    rank runs as many forwards as the busiest one. A stand-in's loss is multiplied by zero.
    """
    if strategy is None:
        return mine
    wanted = max(len(p) for p in parts) if strategy == "fsdp2" else 1
    return mine + [0] * max(0, wanted - len(mine))


def _optimizer_step(ctx: StepContext, loss: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Clip, step, schedule, zero; returns the (device) grad norm and the lr the step used.

    A step whose ``loss`` or grad norm is not finite is not applied (``trainer.training.guards.arm``)."""
    params = [p for group in ctx.optimizer.param_groups for p in group["params"]]
    max_norm = ctx.max_grad_norm if ctx.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, possibly a partial sum per rank
        grad_norm = grad_norm.full_tensor()  # a collective queued on the stream, no host sync
    lr = ctx.scheduler.get_last_lr()[0]
    if guards.arm(ctx.optimizer, loss, grad_norm):
        ctx.optimizer.step()
    ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def evaluate(ctx: StepContext, samples: list[Sample], batch_tokens: int) -> tuple[float, int, float | None]:
    """Validation loss over ``samples`` (the loss sum over the denominator: target tokens, or
    DPO's pairs), its denominator and the objective's accuracy (``Objective.eval_accuracy``: the
    fraction of targets the model ranks first for SFT; None for DPO, whose loss ranks no tokens).

    Each rank packs all batches alike and evaluates every W-th; the sums are gathered (a
    collective). Under FSDP2 every forward gathers parameters with all ranks, so a rank with one
    batch fewer runs its first batch again and drops the result.
    """
    model = ctx.model
    model.eval()
    total, targets = 0.0, 0
    objective = ctx.objective
    stats = objective.new_stats(ctx.device)
    batches = pack_indices([len(s) for s in samples], range(len(samples)), batch_tokens)
    world = ctx.comm.world
    rounds = -(-len(batches) // world.world_size)
    try:
        with torch.no_grad():
            for k in range(rounds):
                index = world.rank + k * world.world_size
                if index >= len(batches) and ctx.parallel.strategy != "fsdp2":
                    break
                indices = batches[index] if index < len(batches) else batches[0]
                batch, meta = ctx.installed.micro_batch(objective.pack([samples[i] for i in indices]), ctx.device)
                with ctx.autocast, objective.collecting(stats if index < len(batches) else None):
                    loss = ctx.parallel.loss(batch, meta, 1).item()
                if index < len(batches):
                    total += loss
                    targets += batch.num_targets
    finally:
        model.train()
    rows = ctx.comm.gather_host([total, float(targets), *stats.tolist()], "eval loss")
    total, targets = sum(r[0] for r in rows), int(sum(r[1] for r in rows))
    sums = [sum(r[i] for r in rows) for i in range(2, 2 + stats.numel())]
    return total / max(targets, 1), targets, objective.eval_accuracy(sums, targets)


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
