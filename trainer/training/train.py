"""The training run: ``run(config, emit)`` reads top to bottom as set-up, train, clean-up.

Set-up: seed, detect the hardware, plan, load tokenizer + data + model, build optimizer and
schedule, resume from the newest checkpoint. The job's objective (``trainer.objectives``, by
``config.objective``) loads the records and builds the loss; the loop never asks which it is. Train: one optimizer step per group of
``grad_accum`` packed micro-batches; the loss is the sum of token losses divided by the step's
target count (known on the host before the step), so accumulation is exact however the tokens fall
into micro-batches. Clean-up: final checkpoint, the trained weights exported to
``output_dir/adapter`` (``output_dir/model`` for full fine-tuning), validation, one ``done`` event.

Optimizations: ``trainer.plan.planner.plan`` decides, ``trainer.training.install.install`` applies the whole
plan once to the loaded model (packed attention and its metadata cache, MoE routing, activation
offload, the LoRA kernel, fused elementwise ops, the loss kernel); the step (``trainer.training.step``)
only calls the installation's ``micro_batch`` and ``loss``.

Step results are read one step late (see ``trainer.training.metrics``): the loop queues step k, then reads
the loss, grad norm and timings of step k-1 and emits its ``step`` event; the last one is flushed
at the end. SIGTERM/SIGINT set a flag checked between steps: the run finishes the step it is in,
writes a checkpoint and ends ``cancelled``.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from trainer.training import checkpoint, evaluation, layout, metrics
from trainer.parallel import distributed, strategy as parallel
from trainer.plan import hardware, memory, planner as planning
from trainer import objectives
from trainer.config import TrainConfig
from trainer.errors import ConfigError, error_code
from trainer.generate.samples import Sampler
from trainer.training.guards import NonFiniteGuard
from trainer.features.checkpointing.policy import BUDGET_ENV, BUDGET_RANKS_ENV
from trainer.training.install import install
from trainer.model.load import count_parameters, load_model, load_tokenizer, model_facts, prepare_for_training
from trainer.objectives.base import Objective
from trainer.parallel.oom_ladder import Ladder
from trainer.data.packing import BatchSchedule
from trainer.training.step import PendingStep, StepContext, lr_lambda, train_step

Emit = Callable[..., Any]


@dataclass(frozen=True)
class RunResult:
    status: str
    """``succeeded``, ``failed`` or ``cancelled`` (as in the ``done`` event)."""
    steps: int
    adapter_path: str | None = None
    error_code: str | None = None
    message: str | None = None


class StopFlag:
    """Set by a signal handler (or a caller) to end the run cleanly after the current step."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str = "stop requested") -> None:
        self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def run(config: TrainConfig, emit: Emit, stop: StopFlag | None = None) -> RunResult:
    """Train as ``config`` says, emitting events through ``emit(type, **fields)``; never raises.

    Every run ends with exactly one ``done`` event, whose fields the returned ``RunResult`` repeats.
    """
    stop = stop or StopFlag()
    progress = {"step": 0}
    world = distributed.World()
    with _stop_on_signals(stop):
        try:
            world = distributed.World.from_env()
            if not world.is_main:  # rank 0 alone reports; the others' failures go to stderr
                emit = _silent
            result = _train(config, emit, stop, progress, world)
        except BaseException as exc:  # noqa: BLE001 - every failure must end as a done event
            print(f"rank {world.rank}:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            message = f"{type(exc).__name__}: {exc}" if error_code(exc) == "internal_error" else str(exc)
            if world.is_distributed:
                message = f"rank {world.rank}: {message}"
            result = RunResult("failed", progress["step"], None, error_code(exc), message)
    emit(
        "done",
        status=result.status,
        error_code=result.error_code,
        message=result.message,
        adapter_path=result.adapter_path,
        steps=result.steps,
    )
    return result


def _silent(*args: Any, **kwargs: Any) -> None:
    """The ``emit`` of ranks other than 0."""


@dataclass
class Run:
    """One training run between set-up and clean-up: what the loop reads and advances."""

    config: TrainConfig
    emit: Emit
    stop: StopFlag
    hw: hardware.Hardware
    ctx: StepContext
    schedule: BatchSchedule
    validation: list[Any] | None
    state: checkpoint.TrainingState
    last_checkpoint_step: int
    """The step of the newest checkpoint on disk (-1: none written or resumed from)."""
    guard: NonFiniteGuard
    """Counts non-finite steps in a row (``trainer.training.guards``)."""
    sampler: Sampler | None = None
    """Greedy generations at checkpoints (``trainer.generate.samples``); None when the job asks for none."""
    ladder: Ladder | None = None
    """Steps the activation policy down on an OOM in the first steps (``trainer.parallel.oom_ladder``)."""

    def write_checkpoint(self, final: bool) -> None:
        """Every rank takes part (``checkpoint.save``): rank 0 alone writes adapters (the same on
        every DDP rank), each rank its shards for full fine-tuning / FSDP2; all return once the
        checkpoint is in place, so no rank runs ahead of one that is not there yet."""
        ctx = self.ctx
        path, size = checkpoint.save(
            self.config.checkpoint_home, ctx.model, ctx.optimizer, ctx.scheduler, self.state, ctx.comm,
            sharded=checkpoint.uses_dcp(self.config.method, ctx.parallel.strategy), final=final,
        )
        self.emit("checkpoint", step=self.state.step, path=str(path), bytes=size, final=final)
        self.last_checkpoint_step = self.state.step
        if self.ladder is not None:
            self.ladder.close()  # a step after a checkpoint is no longer retried

    def emit_step(self, pending: PendingStep) -> None:
        event = pending.event(self.schedule.total_steps, self.hw.peak_flops, self.ctx.comm)
        self.emit("step", **event)
        take = getattr(self.ctx.objective, "take_rollouts", None)  # GRPO's first rollouts of the step
        shown = take(pending.step) if take is not None else None
        if shown:
            self.emit("rollouts", step=pending.step, rollouts=shown)
        self.guard.check(event, self.emit, self.last_checkpoint_step)  # raises at the limit

    def stopping(self) -> bool:
        """Whether any rank was asked to stop (all ranks agree, so they stop at the same step)."""
        return self.ctx.comm.any_rank(self.stop.is_set())

    def log(self, message: str, level: str = "info") -> None:
        self.emit("log", level=level, message=message)


def _train(
    config: TrainConfig, emit: Emit, stop: StopFlag, progress: dict[str, int], world: distributed.World
) -> RunResult:
    if world.world_size > config.global_micro_batches:
        raise ConfigError(
            f"{world.world_size} ranks for a global step of {config.global_micro_batches} micro-batches "
            f"(gpus {config.gpus} x optim.grad_accum {config.optim.grad_accum}): raise gpus or grad_accum, "
            "or launch fewer ranks"
        )
    use_cuda = config.device != "cpu" and torch.cuda.is_available()
    device = distributed.device_for(world, "cuda" if use_cuda else "cpu")
    comm = distributed.Comm(world, device).start()
    try:
        r = _setup(config, emit, stop, comm)
        r.ladder = Ladder(r.ctx.installed, r.ctx.optimizer, r.ctx.device, r.hw, r.log,
                         enabled=not world.is_distributed or r.ctx.parallel.can_agree,
                         parallel=r.ctx.parallel if world.is_distributed else None)
        progress["step"] = r.state.step
        if r.stopping():  # stopped while loading: nothing trained since the last checkpoint
            r.log(f"{stop.reason or 'another rank stopped'}: stopped before training", "warning")
            return RunResult("cancelled", r.state.step)
        stopped = _loop(r, progress)
        return stopped or _finish(r)
    finally:
        gc.unfreeze()  # frozen by _setup; a process that runs several trainings frees each one's objects
        comm.close()


# ---- set-up -------------------------------------------------------------------------------------


def _setup(config: TrainConfig, emit: Emit, stop: StopFlag, comm: distributed.Comm) -> Run:
    """Seed, detect, plan, load data and model, install the plan, wrap it for the ranks (``comm``
    has joined them), build the optimizer, resume."""
    _seed_everything(config.seed)
    world, device = comm.world, comm.device
    hw = hardware.detect(config.device)
    plan = planning.plan(hw, config, model_facts(config), world.world_size, _free_gpu_bytes(comm))
    emit("log", level="info", message=f"loading tokenizer and data for {config.model.name_or_path}")
    objective: Objective = objectives.load(config.objective)
    train_samples, validation = objective.load_data(config, load_tokenizer(config))
    emit(
        "log",
        level="info",
        message=f"loading model ({plan.dtype}, {plan.attention_backend} attention) on {hw.describe()}",
    )
    model = prepare_for_training(load_model(config, plan, device), config)
    installed = install(model, plan, _test_activation_budget(world.rank))
    for line in installed.describe():
        emit("log", level="info", message=line)
    loss = objective.build_loss(config, model, installed, plan.decision(parallel.NAME).backend)
    # after build_loss: an item's length may depend on what the installed plan runs (GRPO's shared prompts)
    schedule = BatchSchedule(
        [len(s) for s in train_samples],
        config.data.batch_tokens,
        config.seed,
        config.global_micro_batches,
        max_steps=config.optim.max_steps,
        epochs=config.optim.epochs,
    )
    wrapped = parallel.parallelize(
        model, loss, plan.decision(parallel.NAME), comm,
        static_graph=installed.offloader.enabled, compute_dtype=plan.dtype,
    )
    optimizer, scheduler = _optimizer(model, config, schedule.total_steps, device)
    installed.watch(optimizer)
    ctx = StepContext(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        samples=train_samples,
        installed=installed,
        device=device,
        autocast=torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and plan.dtype != "float32"
        else nullcontext(),
        flops=metrics.FlopCounter.for_model(model),
        max_grad_norm=config.optim.max_grad_norm,
        parallel=wrapped,
        comm=comm,
        objective=objective,
    )
    r = Run(config, emit, stop, hw, ctx, schedule, validation, checkpoint.TrainingState(step=0, data_position=0), -1,
            NonFiniteGuard(config.max_non_finite_steps))
    if config.sample_prompts or config.sample_count:
        r.sampler = Sampler.for_run(config, load_tokenizer(config))
    resumed = _resume(r)
    _emit_plan(r, plan, resumed)
    _freeze_setup_objects()
    return r


def _freeze_setup_objects() -> None:
    """Move everything set-up made (the model's modules, the samples) to the permanent generation:
    the collector's full passes no longer walk it during the loop, where a pass over a large
    model's objects can stall a host-bound step (Qwen3-0.6B). ``_train`` unfreezes at the end."""
    gc.collect()
    gc.freeze()


def _free_gpu_bytes(comm: distributed.Comm) -> int | None:
    """The GPU memory free now (before the model loads), the least over the ranks: every rank
    must pick the same activation policy (DDP's graph, FSDP2's collectives)."""
    free = memory.free_gpu_bytes(comm.device)
    if free is None:
        return None
    return int(min(row[0] for row in comm.gather_host([float(free)], "free memory")))


def _test_activation_budget(rank: int) -> int | None:
    """Tests only: ``FTQ_TEST_ACTIVATION_BUDGET_BYTES``, read once, on the ranks listed in
    ``FTQ_TEST_ACTIVATION_BUDGET_RANKS`` (all when unset) (``trainer.features.checkpointing.policy``)."""
    raw, ranks = os.environ.get(BUDGET_ENV), os.environ.get(BUDGET_RANKS_ENV)
    if ranks and str(rank) not in ranks.split(","):
        return None
    return int(raw) if raw else None


def _test_slow_stop_checkpoint() -> None:
    """Tests only: every rank waits ``FTQ_TEST_STOP_CHECKPOINT_DELAY_S`` seconds before the
    checkpoint a stop writes (unset in production): a large model's checkpoint, which a launcher
    that kills its ranks too early would cut (tests/integration/e2e/test_slurm_e2e.py)."""
    delay = float(os.environ.get("FTQ_TEST_STOP_CHECKPOINT_DELAY_S") or 0)
    if delay > 0:
        time.sleep(delay)


def _optimizer(
    model: torch.nn.Module, config: TrainConfig, total_steps: int, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optim = config.optim
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim.learning_rate,
        weight_decay=optim.weight_decay,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(optim.lr_scheduler, optim.warmup_steps, total_steps)
    )
    return optimizer, scheduler


def _resume(r: Run) -> bool:
    """Load the newest checkpoint (in ``checkpoint_home``) when the job resumes; True when one was loaded."""
    path = checkpoint.latest_checkpoint(r.config.checkpoint_home) if r.config.resume else None
    if path is None:
        return False
    r.state = checkpoint.load_checkpoint(path, r.ctx.model, r.ctx.optimizer, r.ctx.scheduler)
    r.last_checkpoint_step = r.state.step
    r.log(f"resumed from {path} at step {r.state.step}")
    return True


def _emit_plan(r: Run, plan: planning.Plan, resumed: bool) -> None:
    model = r.ctx.model
    total, trainable = count_parameters(model)
    r.emit(
        "plan",
        hardware=r.hw.to_dict(),
        **plan.to_dict(),
        total_steps=r.schedule.total_steps,
        model={
            "name": r.config.model.name_or_path,
            "params": total,
            "trainable_params": trainable,
            "layers": model.config.num_hidden_layers,
        },
        resumed_from_step=r.state.step if resumed else None,
        world_size=r.ctx.comm.world.world_size,
    )


# ---- train --------------------------------------------------------------------------------------


def _loop(r: Run, progress: dict[str, int]) -> RunResult | None:
    """Every remaining step; a ``cancelled`` result when a stop ends it early, else None."""
    pending: PendingStep | None = None
    for step, refs in r.schedule.steps(r.state.step):
        queued = r.ladder.run(step, lambda: train_step(r.ctx, step, refs)) if r.ladder else train_step(r.ctx, step, refs)
        if pending is not None:
            r.emit_step(pending)  # read one step late: step k-1's values are done by now
        pending = queued
        r.state = checkpoint.TrainingState(step=step, data_position=refs[-1].index + 1)
        progress["step"] = step
        is_last = step == r.schedule.total_steps
        every = r.config.checkpoint_every
        stopping = r.stopping()
        checkpointing = bool(stopping or is_last or (every and step % every == 0))
        eval_loss = not stopping and evaluation.is_eval_due(r.config, step, checkpointing=checkpointing, is_last=is_last)
        if checkpointing or eval_loss:
            r.emit_step(pending)
            pending = None
            if checkpointing:
                if stopping:
                    _test_slow_stop_checkpoint()
                r.write_checkpoint(final=is_last)
            if not stopping:
                _evaluate(r, eval_loss=eval_loss, samples=checkpointing, final=is_last)
            stopping = stopping or r.stopping()  # asked while the step event was read or written
        if stopping and not is_last:  # a stop during the last step lets the run finish
            r.log(f"{r.stop.reason or 'another rank stopped'}: stopped after step {step}", "warning")
            return RunResult("cancelled", step)
    if pending is not None:
        r.emit_step(pending)
    return None


def _evaluate(r: Run, *, eval_loss: bool, samples: bool, final: bool) -> None:
    """Validation loss and greedy samples after this step (``trainer.training.evaluation``)."""
    evaluation.measure(r.ctx, r.config, r.state.step, r.emit, validation=r.validation, sampler=r.sampler,
                       eval_loss=eval_loss, samples=samples, final=final)


# ---- clean-up -----------------------------------------------------------------------------------


def _finish(r: Run) -> RunResult:
    """The final checkpoint (unless the last step wrote it) and the trained weights exported."""
    # Equal when resumed from a finished run: nothing new was trained, the checkpoint is there.
    if r.last_checkpoint_step != r.state.step:
        r.write_checkpoint(final=True)
    # A full fine-tune's model/ is loaded on its own (job:<id>): it carries the tokenizer it trained with.
    tokenizer = load_tokenizer(r.config) if r.config.method == "full" and r.ctx.comm.world.is_main else None
    export = checkpoint.export(
        r.ctx.model, layout.export_dir(r.config.output_dir, r.config.method), r.ctx.comm,
        sharded=r.ctx.parallel.sharded, tokenizer=tokenizer,
    )
    r.log(f"saved trained weights to {export}")
    return RunResult("succeeded", r.state.step, str(export))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


@contextmanager
def _stop_on_signals(stop: StopFlag) -> Iterator[None]:
    """Turn SIGTERM / SIGINT into ``stop`` while the run lasts (main thread only), then restore."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = lambda signum, _frame: stop.set(f"received {signal.Signals(signum).name}")
    previous = {
        sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
