"""The training run: ``run(config, emit)`` reads top to bottom as set-up, train, clean-up.

Set-up: seed, detect the hardware, plan, load tokenizer + data + model, build optimizer and
schedule, resume from the newest checkpoint. Train: one optimizer step per group of
``grad_accum`` packed micro-batches; the loss is the sum of token losses divided by the step's
target count (known on the host before the step), so accumulation is exact however the tokens fall
into micro-batches. Clean-up: final checkpoint, the trained weights exported to
``output_dir/adapter`` (``output_dir/model`` for full fine-tuning), validation, one ``done`` event.

Optimizations (``trainer.hardware.plan`` decides, ``_install_optimizations`` applies them once to
the loaded model): ``ftq_packed`` attention with the packed-metadata cache on or off
(``trainer.attention``; metadata built once per micro-batch from the host lengths in
``_micro_batches``), the loss kernel (``trainer.fused_loss`` or full logits, through
``trainer.model.packed_loss`` with the step's label count, so accumulation is exact either way),
MoE grouped routing (``trainer.moe_routing``) and offloaded activation checkpointing with the
double-buffered reload (``trainer.offload``).

Step results are read one step late (see ``trainer.metrics``): the loop queues step k, then reads
the loss, grad norm and timings of step k-1 and emits its ``step`` event; the last one is flushed
at the end. SIGTERM/SIGINT set a flag checked between steps: the run finishes the step it is in,
writes a checkpoint and ends ``cancelled``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import (
    checkpoint,
    fused_ops,
    hardware,
    lora_fused,
    metrics,
    moe_routing,
    offload,
)
from trainer.attention import PackedAttention
from trainer.config import TrainConfig
from trainer.dataset import Sample, load_samples
from trainer.errors import error_code
from trainer.model import (
    count_parameters,
    load_model,
    load_tokenizer,
    model_facts,
    packed_loss,
    prepare_for_training,
)
from trainer.offload import ActivationOffloader, NoOffload
from trainer.packed_metadata import AnyPackedMetadata
from trainer.packing import BatchSchedule, MicroBatchRef, PackedBatch, pack_batch

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
    with _stop_on_signals(stop):
        try:
            result = _train(config, emit, stop, progress)
        except BaseException as exc:  # noqa: BLE001 - every failure must end as a done event
            traceback.print_exc(file=sys.stderr)
            message = (
                f"{type(exc).__name__}: {exc}"
                if error_code(exc) == "internal_error"
                else str(exc)
            )
            result = RunResult(
                "failed", progress["step"], None, error_code(exc), message
            )
    emit(
        "done",
        status=result.status,
        error_code=result.error_code,
        message=result.message,
        adapter_path=result.adapter_path,
        steps=result.steps,
    )
    return result


def _train(
    config: TrainConfig, emit: Emit, stop: StopFlag, progress: dict[str, int]
) -> RunResult:
    # ---- set-up -------------------------------------------------------------------------------
    _seed_everything(config.seed)
    hw = hardware.detect(config.device)
    plan = hardware.plan(hw, config.optimizations, config, model_facts(config))
    device = torch.device(hw.device)

    emit(
        "log",
        level="info",
        message=f"loading tokenizer and data for {config.model.name_or_path}",
    )
    tokenizer = load_tokenizer(config)
    train_samples = load_samples(
        config.data.train_path, tokenizer, config.data.format, config.data.max_seq_len
    )
    val_samples = (
        load_samples(
            config.data.validation_path,
            tokenizer,
            config.data.format,
            config.data.max_seq_len,
        )
        if config.data.validation_path
        else None
    )
    schedule = BatchSchedule(
        [len(s) for s in train_samples],
        config.data.batch_tokens,
        config.seed,
        config.optim.grad_accum,
        max_steps=config.optim.max_steps,
        epochs=config.optim.epochs,
    )

    emit(
        "log",
        level="info",
        message=f"loading model ({plan.dtype}, {plan.attention_backend} attention) on {hw.describe()}",
    )
    model = prepare_for_training(load_model(config, plan, device), config)
    opt = _install_optimizations(model, plan)
    for line in opt.describe():
        emit("log", level="info", message=line)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=config.optim.learning_rate,
        weight_decay=config.optim.weight_decay,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        _lr_lambda(
            config.optim.lr_scheduler, config.optim.warmup_steps, schedule.total_steps
        ),
    )

    state = checkpoint.TrainingState(step=0, data_position=0)
    resumed_from = (
        checkpoint.latest_checkpoint(config.output_dir) if config.resume else None
    )
    if resumed_from is not None:
        state = checkpoint.load_checkpoint(resumed_from, model, optimizer, scheduler)
        emit(
            "log",
            level="info",
            message=f"resumed from {resumed_from} at step {state.step}",
        )
    progress["step"] = state.step

    total, n_trainable = count_parameters(model)
    emit(
        "plan",
        hardware=hw.to_dict(),
        **plan.to_dict(),
        total_steps=schedule.total_steps,
        model={
            "name": config.model.name_or_path,
            "params": total,
            "trainable_params": n_trainable,
            "layers": model.config.num_hidden_layers,
        },
        resumed_from_step=state.step if resumed_from is not None else None,
    )

    # ---- train --------------------------------------------------------------------------------
    flops = metrics.FlopCounter.for_model(model)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and plan.dtype != "float32"
        else nullcontext()
    )
    last_checkpoint_step = state.step if resumed_from is not None else -1
    pending: _PendingStep | None = None
    if (
        stop.is_set()
    ):  # stopped while loading: nothing trained since the last checkpoint
        emit("log", level="warning", message=f"{stop.reason}: stopped before training")
        return RunResult("cancelled", state.step)
    for step, refs in schedule.steps(state.step):
        pending_now = _train_step(
            model,
            optimizer,
            scheduler,
            train_samples,
            step,
            refs,
            device,
            autocast,
            config,
            flops,
            opt,
        )
        if pending is not None:
            emit("step", **pending.read(schedule.total_steps, hw.peak_flops))
        pending = pending_now
        state = checkpoint.TrainingState(step=step, data_position=refs[-1].index + 1)
        progress["step"] = step
        is_last = step == schedule.total_steps
        if (
            stop.is_set()
            or is_last
            or (config.checkpoint_every and step % config.checkpoint_every == 0)
        ):
            emit("step", **pending.read(schedule.total_steps, hw.peak_flops))
            pending = None
            _write_checkpoint(
                config, model, optimizer, scheduler, state, emit, final=is_last
            )
            last_checkpoint_step = step
            if val_samples is not None and not stop.is_set():
                _evaluate(model, val_samples, config, device, autocast, step, emit, opt)
        if (
            stop.is_set() and not is_last
        ):  # a stop during the last step lets the run finish
            emit(
                "log",
                level="warning",
                message=f"{stop.reason}: stopped after step {step}",
            )
            return RunResult("cancelled", step)

    # ---- clean-up -----------------------------------------------------------------------------
    if pending is not None:
        emit("step", **pending.read(schedule.total_steps, hw.peak_flops))
    # Equal when resumed from a finished run: nothing new was trained, the checkpoint is there.
    if last_checkpoint_step != state.step:
        _write_checkpoint(config, model, optimizer, scheduler, state, emit, final=True)
    export = Path(config.output_dir) / (
        "model" if config.method == "full" else "adapter"
    )
    checkpoint.export_weights(model, export)
    emit("log", level="info", message=f"saved trained weights to {export}")
    return RunResult("succeeded", state.step, str(export))


@dataclass(frozen=True)
class _Optimizations:
    """What ``_install_optimizations`` applied to the model, as the step needs it."""

    attention: PackedAttention | None
    """Packed attention on the model (cache on or off), or None: the model's own attention."""
    loss_kernel: str
    """``fused_chunked_ce`` or ``torch_cross_entropy`` (``trainer.model.packed_loss``)."""
    offloader: ActivationOffloader | NoOffload = dataclasses.field(
        default_factory=NoOffload
    )
    """Offloaded checkpointing on the decoder layers (double-buffered or synchronous), or the no-op twin."""
    moe: moe_routing.InstallResult | None = None
    """What ``trainer.moe_routing.install`` did (grouped or eager), or None for a dense model."""
    lora: lora_fused.InstallResult | None = None
    """The LoRA layers ``trainer.lora_fused`` patched, or None: peft's own forward."""
    fused: fused_ops.InstallResult | None = None
    """The RMSNorm / MLP / RoPE pieces ``trainer.fused_ops`` patched, or None: transformers' ops."""

    def describe(self) -> list[str]:
        """One line per installed piece, for the run's log."""
        lines = []
        if self.lora is not None:
            lines.append(f"LoRA kernel: {self.lora.describe()}")
        if self.fused is not None:
            lines.append(f"fused elementwise: {self.fused.describe()}")
        if self.moe is not None:
            lines.append(f"MoE routing: {self.moe.describe()}")
        if self.offloader.enabled:
            how = (
                "double-buffered reload"
                if self.offloader.double_buffer
                else "synchronous reload"
            )
            lines.append(
                f"activation offload: {self.offloader.num_layers} decoder layers, {how}"
            )
        return lines

    def micro_batch(
        self, batch: PackedBatch, device: torch.device
    ) -> tuple[PackedBatch, AnyPackedMetadata | None]:
        """Move ``batch`` to ``device`` and build its metadata from the host lengths (no sync)."""
        meta = (
            self.attention.metadata(batch.lengths, device)
            if self.attention is not None
            else None
        )
        return batch.to(device, non_blocking=True), meta


def _install_optimizations(
    model: torch.nn.Module, plan: hardware.Plan
) -> _Optimizations:
    """Apply the plan's decisions to the loaded (and LoRA-wrapped) model, once.

    Packed attention: every model it can run gets it (the cache switch picks the cached metadata
    or the rebuild-per-layer twin); the others keep their own attention with packed block masks
    (``trainer.model.packed_attention_masks``).

    MoE routing (``moe_grouped_routing``): on a model with recognised experts modules, every one
    is patched to the grouped argsort path (enabled) or to transformers' eager per-expert loop
    (off: the honest "before", whatever ``config._experts_implementation`` says). Triton pieces
    only where they run (CUDA); expert LoRA (peft ``target_parameters``) is read through the
    same forward.

    Activation offload (``offload_activations``, ``double_buffered_reload``): an
    ``ActivationOffloader`` wraps the decoder layers after peft (so the adapters are inside the
    recompute), replacing transformers' checkpoint wrapper for those layers; with offload off
    the model keeps plain gradient checkpointing.

    LoRA kernel (``plan.lora``): peft's LoRA linear layers run through ``trainer.lora_fused``
    (compute dtype, update fused into the base matmul) unless the plan keeps peft's forward.
    Fused elementwise kernels (``plan.fused_ops``): RMSNorm, SwiGLU and RoPE through Triton on a
    CUDA GPU (``trainer.fused_ops``).
    """
    attention = None
    if plan.packed_attention:
        attention = PackedAttention(
            plan.attention_backend,
            cache=plan.decision("packed_metadata_cache").enabled,
        )
        attention.install(model)
    moe = None
    if moe_routing.experts_modules(model):
        enabled = plan.decision("moe_grouped_routing").enabled
        moe = moe_routing.install(model, enabled, triton=None if enabled else False)
    offloader = offload.build(
        torch.device(plan.device),
        offload=plan.decision("offload_activations").enabled,
        double_buffer=plan.decision("double_buffered_reload").enabled,
    )
    offloader.apply(model)
    lora = lora_fused.install(model) if plan.lora.enabled else None
    fused = fused_ops.install(model, triton=True) if plan.fused_ops.enabled else None
    return _Optimizations(
        attention=attention,
        loss_kernel=plan.loss_kernel,
        offloader=offloader,
        moe=moe,
        lora=lora,
        fused=fused,
    )


@dataclass
class _PendingStep:
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

    def read(self, total_steps: int, peak_flops: float | None) -> dict[str, Any]:
        times = self.timing.read()
        seconds = times["step_ms"] / 1000.0
        return {
            "step": self.step,
            "total_steps": total_steps,
            "epoch": round(self.epoch, 4),
            "loss": self.loss.item(),
            "lr": self.lr,
            "grad_norm": self.grad_norm.item(),
            "tokens": self.tokens,
            "sequences": self.sequences,
            **times,
            "tokens_per_s": self.tokens / seconds if seconds > 0 else None,
            "mfu": metrics.mfu(self.flops, times["step_ms"], peak_flops),
            **self.memory,
        }


def _train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    samples: list[Sample],
    step: int,
    refs: list[MicroBatchRef],
    device: torch.device,
    autocast: Any,
    config: TrainConfig,
    flops: metrics.FlopCounter,
    opt: _Optimizations,
) -> _PendingStep:
    """Queue one optimizer step over the micro-batches ``refs``; returns it unread.

    Every micro-batch's loss is its token-loss sum divided by the label count of the whole
    step (a host int from the packer), so the accumulated gradient is the step's mean exactly.
    Nothing here reads a device value back: the losses and the grad norm stay on the device.
    """
    timer = metrics.StepTimer(device)
    metrics.reset_peak_memory(device)
    batches = [pack_batch([samples[i] for i in ref.sample_indices]) for ref in refs]
    step_targets = sum(b.num_targets for b in batches)
    total_loss = torch.zeros((), device=device)
    lengths: list[int] = []
    for host_batch in batches:
        with timer.phase("data"):
            batch, meta = opt.micro_batch(host_batch, device)
        with timer.phase("forward"), autocast:
            loss = packed_loss(model, batch, meta, opt.loss_kernel, step_targets)
        with timer.phase("backward"):
            loss.backward()
        total_loss += loss.detach()
        lengths.extend(batch.lengths)
    with timer.phase("optimizer"):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        max_norm = (
            config.optim.max_grad_norm
            if config.optim.max_grad_norm > 0
            else float("inf")
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return _PendingStep(
        step=step,
        epoch=refs[-1].epoch,
        loss=total_loss,
        grad_norm=grad_norm,
        lr=lr,
        tokens=sum(lengths),
        sequences=len(lengths),
        flops=flops.step_flops(lengths),
        timing=timer.finish(),
        memory=metrics.memory_stats(device),
    )


def _evaluate(
    model: torch.nn.Module,
    samples: list[Sample],
    config: TrainConfig,
    device: torch.device,
    autocast: Any,
    step: int,
    emit: Emit,
    opt: _Optimizations,
) -> None:
    """Token-weighted validation loss over the whole validation set, as an ``eval`` event."""
    from trainer.packing import pack_indices

    model.eval()
    total, targets = 0.0, 0
    try:
        with torch.no_grad():
            for indices in pack_indices(
                [len(s) for s in samples], range(len(samples)), config.data.batch_tokens
            ):
                batch, meta = opt.micro_batch(
                    pack_batch([samples[i] for i in indices]), device
                )
                with autocast:
                    total += packed_loss(
                        model, batch, meta, opt.loss_kernel, num_items=1
                    ).item()
                targets += batch.num_targets
    finally:
        model.train()
    emit("eval", step=step, loss=total / max(targets, 1), tokens=targets)


def _write_checkpoint(
    config: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: checkpoint.TrainingState,
    emit: Emit,
    final: bool,
) -> None:
    path, size = checkpoint.save_checkpoint(
        config.output_dir, model, optimizer, scheduler, state, final=final
    )
    emit("checkpoint", step=state.step, path=str(path), bytes=size, final=final)


def _lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
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
