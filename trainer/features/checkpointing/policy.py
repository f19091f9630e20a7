"""The activation policy: which decoder layers keep their activations for backward.

One decision, ``gradient_checkpointing`` (the job's field: ``auto | on | off | selective``), with
the policy as its backend, from the fastest down:

| backend | on the GPU between forward and backward | recompute |
|---|---|---|
| ``none`` | every layer's activations | nothing |
| ``selective:n/L`` | the first n layers keep only their input, the others everything | n layers |
| ``full`` | every layer's input | every layer |
| ``full+offload`` | the inputs in pinned host memory (``offload_activations``) | every layer |

``auto`` takes the first policy whose estimate (``trainer.plan.memory``) fits in the GPU's free
memory at start (or the job's ``max_gpu_memory_gb``) minus the margin, and says so with the
figures: ``keep all: est. 84.6 GiB (...) of 139.7 GiB free - 6.2 GiB margin``. Checkpointing
L-1 layers always needs less than ``full`` (the last layer's input is not held beside its
recompute), so after selective ``auto`` goes to ``full+offload``, and to ``full`` only when
offloading cannot run (CPU, no pinned memory or host room, FSDP2, ``offload_activations: off``). ``on`` is
full checkpointing (offloaded only when even that does not fit, or when
``offload_activations`` is on), ``off`` keeps everything, ``selective`` checkpoints as few
layers as fit. Without a GPU, or a model whose shape is unknown, there is nothing to estimate
against: ``auto`` checkpoints every layer (the previous default) and the offload switch keeps
its own rule.

Why selective checkpointing by whole layers, and not "the cheap-to-recompute parts" (an op-level
policy that saves the matmul outputs and recomputes norms and activations): memory falls
linearly with the count of checkpointed layers, so the count can be chosen to use exactly the
memory there is (the op-level policy saves a fixed ~40% and cannot fit anything bigger), the
estimate stays exact arithmetic, and it composes with every other piece (the Triton kernels and
the fused LoRA are ``autograd.Function``s an op-level policy does not see into, MoE routing,
FSDP2's hooks outside ``forward``). n of L layers rather than every k-th: ``L/k`` leaves big
gaps (all, half, a third), n uses the memory to the layer. The first n: backward reaches them
last, when the kept layers' activations are already freed, so their recompute adds nothing to
the peak (checkpointing the last layers instead would recompute one while all the others are
still held).

``apply`` sets each decoder layer's transformers checkpointing flag (non-reentrant
``torch.utils.checkpoint``), leaving the model as it was on ``remove()``. Under
``full+offload`` the offloader (``trainer.features.offload.feature``) wraps the layers and
checkpoints them itself.

Test hook: ``apply(..., Target(activation_budget=N))`` counts the bytes the decoder layers save for backward
in one forward and raises ``torch.OutOfMemoryError`` once they pass N, so the OOM ladder
(``trainer.parallel.oom_ladder``) is exercised on a CPU through the real step. ``trainer.training.train`` reads
it once at start from ``FTQ_TEST_ACTIVATION_BUDGET_BYTES`` (tests only; unset in production), on
the ranks ``FTQ_TEST_ACTIVATION_BUDGET_RANKS`` lists (one rank of several running out).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from trainer.errors import PlanError
from trainer.features.offload.estimate import policy_unavailable
from trainer.plan import memory
from trainer.plan.feature import Context, Target, how
from trainer.plan.types import Decision, Plan

NAME = "gradient_checkpointing"
OFFLOAD, RELOAD = "offload_activations", "double_buffered_reload"
"""The offload decisions (``trainer.features.offload.feature``) a policy of ``full+offload`` turns on."""
BUDGET_ENV = "FTQ_TEST_ACTIVATION_BUDGET_BYTES"
BUDGET_RANKS_ENV = "FTQ_TEST_ACTIVATION_BUDGET_RANKS"
"""Tests only: the ranks (comma-separated) whose probe ``BUDGET_ENV`` arms; every rank when unset."""
_MISSING = object()


def selective_backend(checkpointed: int, layers: int) -> str:
    return f"selective:{checkpointed}/{layers}"


def checkpointed_count(backend: str | None, layers: int) -> int:
    """Layers a decision's backend checkpoints (of ``layers``)."""
    if backend in (None, "none"):
        return 0
    if backend.startswith("selective:"):
        return int(backend.split(":")[1].split("/")[0])
    return layers


def checkpointed_layers(count: int, layers: int) -> set[int]:
    """The checkpointed layer indices: the first ``count`` of ``layers`` (module docstring)."""
    return set(range(min(count, layers)))


def estimates(ctx: Context) -> bool:
    """Whether the policy is chosen from the memory estimate: a GPU, a model of known shape, and
    neither ``off`` nor ``offload_activations: on`` in the job. The offload decision follows an
    estimated policy (``trainer.features.offload.feature``)."""
    return (
        ctx.job.gradient_checkpointing != "off"
        and ctx.job.switch(OFFLOAD) != "on"
        and ctx.hw.device == "cuda"
        and ctx.facts.shape is not None
    )


def _decide(ctx: Context) -> Decision:
    """The policy (see the module docstring); reads the ``attention`` and ``parallelism`` decisions.

    Raises:
        PlanError: ``selective`` with ``offload_activations: on``.
    """
    job, hw, facts = ctx.job, ctx.hw, ctx.facts
    requested, offload_asked = job.gradient_checkpointing, job.switch(OFFLOAD)
    if requested == "selective" and offload_asked == "on":
        raise PlanError(
            "gradient_checkpointing=selective with offload_activations=on: offloading checkpoints every "
            "layer. Set gradient_checkpointing to auto or on, or offload_activations to auto"
        )
    if not estimates(ctx):
        return _unestimated(ctx)
    sharded = ctx.decision("parallelism").backend == "fsdp2"
    work = memory.Workload(
        tokens=job.batch_tokens, max_seq_len=job.max_seq_len, method=job.method,
        dtype=ctx.dtype, lora_rank=job.lora_r, world_size=ctx.world_size, sharded=sharded,
        fused_loss=facts.fused_loss is None, packed_attention=ctx.decision("attention").enabled,
    )
    cap = None if job.max_gpu_memory_gb is None else int(job.max_gpu_memory_gb * memory.GIB)
    free = ctx.free_gpu_bytes if ctx.free_gpu_bytes is not None else hw.gpu_memory or 0
    offload_missing = policy_unavailable(hw, facts, job.batch_tokens, ctx.dtype, sharded)
    offload = None if offload_asked == "off" else offload_missing is None
    assert facts.shape is not None, "estimates(ctx) checked the shape"
    return _choose(
        requested, facts.shape, work, memory.Budget(free, cap), offload, offload_missing or "offload_activations is off"
    )


def _unestimated(ctx: Context) -> Decision:
    """The policy without an estimate: asked off, offloaded in the job, no GPU or no shape."""
    requested, hw, facts = ctx.job.gradient_checkpointing, ctx.hw, ctx.facts
    if requested == "off":
        return Decision(NAME, "off", False, "none", "off in the job: every layer keeps its activations")
    if ctx.job.switch(OFFLOAD) == "on":
        return Decision(NAME, requested, True, "full+offload",
                        f"{how(requested)}: every layer checkpointed, offload_activations on in the job")
    why = "no GPU memory to plan for" if hw.device != "cuda" else "the model's shape is unknown: no estimate"
    if requested == "selective":
        layers = facts.num_layers or 2
        return Decision(NAME, requested, True, selective_backend(layers // 2, layers),
                        f"selective in the job: half the layers checkpointed ({why})")
    return Decision(NAME, requested, True, "full", f"{how(requested)}: every layer checkpointed ({why})")


def _choose(
    requested: str, shape: memory.Shape, work: memory.Workload, budget: memory.Budget,
    can_offload: bool | None, no_offload: str,
) -> Decision:
    """The first policy that fits, from the one ``requested`` allows (see the module table)."""
    usable, of = budget.usable, f"of {budget.describe()}"
    est = {p: memory.estimate(shape, work, p) for p in ("none", "full", "full+offload")}
    if requested == "auto" and est["none"].peak <= usable:
        return Decision(NAME, requested, False, "none", f"keep all: {est['none'].describe()} {of}")
    if requested in ("auto", "selective"):
        chosen = memory.fewest_checkpointed(shape, work, usable)
        if chosen is not None or requested == "selective":
            chosen = chosen or memory.estimate(shape, work, "selective", shape.layers - 1)
            n = chosen.checkpointed_layers
            fits = "" if chosen.peak <= usable else " (does not fit: the OOM ladder steps down if it runs out)"
            return Decision(
                NAME, requested, True, selective_backend(n, shape.layers),
                f"{'selective in the job' if requested == 'selective' else 'auto'}: checkpoint {n} of "
                f"{shape.layers} layers: {chosen.describe()} {of}{fits}; keep all: est. {est['none'].peak / memory.GIB:.1f} GiB",
            )
    full = est["full"]
    if full.peak <= usable or not can_offload:
        fits = "" if full.peak <= usable else f" (does not fit; no offload: {no_offload})"
        return Decision(NAME, requested, True, "full", f"{how(requested)}: every layer checkpointed: {full.describe()} {of}{fits}")
    return Decision(
        NAME, requested, True, "full+offload",
        f"{how(requested)}: every layer checkpointed, inputs offloaded: {est['full+offload'].describe()} {of}; "
        f"full checkpointing alone: est. {full.peak / memory.GIB:.1f} GiB",
    )


def with_policy(plan: Plan, backend: str, reason: str, reload: str = "double") -> Plan:
    """``plan`` with the activation policy ``backend`` and the offload decisions it implies
    (``full+offload``: offloaded with the ``reload`` mode; any other: not offloaded). For the OOM
    ladder, and the benches and tests that run each policy."""
    offloaded = backend == "full+offload"
    changed = {
        NAME: dataclasses.replace(plan.decision(NAME), enabled=backend != "none", backend=backend, reason=reason),
        RELOAD: dataclasses.replace(
            plan.decision(RELOAD), enabled=offloaded and reload == "double", backend=reload if offloaded else None,
            reason=reason,
        ),
        OFFLOAD: dataclasses.replace(
            plan.decision(OFFLOAD), enabled=offloaded, backend=reload if offloaded else None, reason=reason
        ),
    }
    return dataclasses.replace(plan, decisions=tuple(changed.get(d.name, d) for d in plan.decisions))


class CheckpointingHandle:
    """Each decoder layer's checkpointing flag as the decision says, restored on ``remove()``."""

    def __init__(self, model: torch.nn.Module, backend: str | None, budget_bytes: int | None = None) -> None:
        from trainer.features.offload import decoder_layers

        try:
            self.layers = decoder_layers(model)
        except ValueError:
            if checkpointed_count(backend, 1) or budget_bytes:
                raise
            self.layers = []  # nothing to checkpoint in a model without a decoder-layer list
        self.count = checkpointed_count(backend, len(self.layers))
        self.backend = backend
        chosen = checkpointed_layers(self.count, len(self.layers))
        func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self._saved = [
            (vars(layer).get("gradient_checkpointing", _MISSING), vars(layer).get("_gradient_checkpointing_func", _MISSING))
            for layer in self.layers
        ]
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = i in chosen
            layer._gradient_checkpointing_func = func
        self._probe = _BudgetProbe(model, self.layers, budget_bytes) if budget_bytes else None

    def remove(self) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        for layer, (flag, func) in zip(self.layers, self._saved):
            for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if value is _MISSING:
                    vars(layer).pop(name, None)
                else:
                    setattr(layer, name, value)
        self._saved = []

    def describe(self) -> str | None:
        if self.backend is None:
            return None
        return f"activation policy: {self.backend}, {self.count} of {len(self.layers)} layers checkpointed"


class _BudgetProbe:
    """Tests only: the bytes decoder layers save for backward in one forward, against a budget
    (``torch.OutOfMemoryError`` past it). Parameters saved by reference are not counted."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module], budget: int) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.budget, self.used = budget, 0
        self._params = {p.data_ptr() for p in model.parameters()}
        self._hooks: list[Any] = []
        self._active: list[Any] = []
        self._wrapped: list[tuple[torch.nn.Module, Any]] = []
        # transformers before 5.2x (5.17) checkpoints in GradientCheckpointingLayer.__call__, so a
        # checkpointed layer's forward hooks run inside the checkpoint (and again in its recompute):
        # counting there would see, and keep, every activation. Such a layer is counted around its
        # checkpoint function instead, as later releases' forward wrapper lets the hooks do.
        self._in_call = "__call__" in vars(GradientCheckpointingLayer)
        for index, layer in enumerate(layers):
            self._hooks.append(layer.register_forward_pre_hook(self._enter(index == 0)))
            self._hooks.append(layer.register_forward_hook(self._exit, always_call=True))
            if self._in_call and getattr(layer, "gradient_checkpointing", False):
                inner = layer._gradient_checkpointing_func
                self._wrapped.append((layer, inner))
                layer._gradient_checkpointing_func = self._counted(inner, index == 0)

    def _counts_in_hooks(self, module: torch.nn.Module) -> bool:
        return not (self._in_call and getattr(module, "gradient_checkpointing", False))

    def _enter(self, first: bool) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not (torch.is_grad_enabled() and module.training and self._counts_in_hooks(module)):
                return
            if first:
                self.used = 0
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            ctx.__enter__()
            self._active.append(ctx)

        return hook

    def _counted(self, inner: Callable[..., Any], first: bool) -> Callable[..., Any]:
        def checkpoint(*args: Any, **kwargs: Any) -> Any:
            if first:
                self.used = 0
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                return inner(*args, **kwargs)

        return checkpoint

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active and self._counts_in_hooks(module):
            self._active.pop().__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self._params:
            self.used += t.numel() * t.element_size()
            if self.used > self.budget:
                raise torch.OutOfMemoryError(
                    f"test budget {BUDGET_ENV}={self.budget}: the layers saved {self.used} bytes for backward"
                )
        return t

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for layer, inner in self._wrapped:
            layer._gradient_checkpointing_func = inner
        self._hooks, self._wrapped = [], []


class ActivationPolicy:
    """The ``gradient_checkpointing`` decision: which decoder layers are checkpointed."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return None

    def decide(self, ctx: Context) -> Decision:
        return _decide(ctx)

    def apply(self, model: torch.nn.Module, decision: Decision, target: Target) -> CheckpointingHandle:
        """Set each decoder layer's checkpointing as ``decision``'s backend says (see the module
        docstring); ``target.activation_budget`` arms the test budget probe."""
        return CheckpointingHandle(model, decision.backend, target.activation_budget)


FEATURE = ActivationPolicy()
