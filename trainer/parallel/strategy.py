"""How several ranks train one model: DDP over the adapters, FSDP2 for full fine-tuning.

The plan's ``parallelism`` decision (``FEATURE.decide``) picks one strategy per run, with a reason:

- one rank: none (the model runs as it is);
- LoRA / QLoRA: DDP over the trainable parameters only (frozen weights are never exchanged).
  The adapters' gradients are tens to a few hundred MB: on one machine they are all-reduced once,
  as one flat tensor, after the step's last backward (``Parallel.exchange``: one NCCL call of ~1 ms
  on NVLink for an 8B model's r16 adapters, no wrapper around the model, nothing per micro-batch);
  across machines, where the network is slow, DDP's reducer overlaps them with backward in buckets
  (``ddp_exchange``);
- full fine-tuning, or a LoRA base too big for one GPU: FSDP2 (``fully_shard`` per decoder
  layer, then the root), parameters, gradients and optimizer state sharded over the ranks.

``parallelize(model, loss, decision, comm)`` wraps the module that computes the loss
(``LossModule``: the model and the plan's loss function), so every micro-batch runs through the
strategy's forward (DDP's reducer and FSDP's all-gathers see every call, including the fused
loss, which reads the LM head's weight directly). ``Parallel.sync(last)`` lets gradient
accumulation skip the exchange until a rank's last micro-batch of the step.

Read first: torchtitan ``models/llama3/infra/parallelize.py`` (``apply_fsdp``, ``apply_ddp``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainer.errors import PlanError
from trainer.parallel.distributed import Comm
from trainer.plan.feature import Context
from trainer.plan.types import Decision

NAME = "parallelism"
BASE_SHARE = 0.6
"""A LoRA base whose weights exceed this share of one GPU is sharded (FSDP2) instead of replicated."""
_WEIGHT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class Parallelism:
    """The ``parallelism`` decision: how ``ctx.world_size`` ranks share the model (applied by
    ``parallelize`` once the process group exists, not by the installer)."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return None

    def decide(self, ctx: Context) -> Decision:
        """The strategy for ``ctx.world_size`` ranks on machines like ``ctx.hw``.

        Raises:
            PlanError: the strategy shards the model on more than one machine.
        """
        decision = _strategy(ctx)
        _refuse_sharding_across_machines(decision.backend == "fsdp2", decision.reason,
                                         shared=ctx.job.shared_checkpoints)
        return decision


FEATURE = Parallelism()


def _strategy(ctx: Context) -> Decision:
    hw, method, world_size = ctx.hw, ctx.job.method, ctx.world_size
    if world_size == 1:
        return Decision(NAME, "auto", False, None, "one rank: nothing to exchange")
    over = f"{world_size} ranks over {hw.interconnect}"
    if method == "full":
        return Decision(
            NAME, "auto", True, "fsdp2",
            f"{over}: full fine-tuning shards parameters, gradients and optimizer state "
            "(FSDP2, one unit per decoder layer, fp32 master weights)",
        )
    per_param = 0.5 if method == "qlora" else _WEIGHT_BYTES.get(ctx.dtype, 2)
    weights = (ctx.facts.param_count or 0) * per_param
    if hw.gpu_memory and weights > BASE_SHARE * hw.gpu_memory and method == "lora":
        return Decision(
            NAME, "auto", True, "fsdp2",
            f"{over}: the base's {weights / 2**30:.1f} GiB of weights exceed {BASE_SHARE:.0%} of one "
            f"GPU's {hw.gpu_memory / 2**30:.0f} GiB, so they are sharded (FSDP2)",
        )
    how = (
        "once, as one flat tensor, after the step's last backward"
        if ddp_exchange() == AFTER_BACKWARD
        else "in buckets under backward (DDP's reducer)"
    )
    return Decision(NAME, "auto", True, "ddp", f"{over}: only the adapters' gradients are all-reduced, {how}")


AFTER_BACKWARD = "after_backward"
OVERLAPPED = "overlapped"
EXCHANGE_ENV = "FTQ_DDP_EXCHANGE"
"""Overrides ``ddp_exchange``'s choice (``after_backward`` or ``overlapped``): for an A/B of the two
on one machine (``bench.scaling --env``), not a job setting."""


def ddp_exchange() -> str:
    """How DDP ranks exchange the adapters' gradients: ``after_backward`` on one machine (the
    exchange is ~1 ms over NVLink or PCIe, and skipping DDP's wrapper saves its per-forward
    bookkeeping and hooks), ``overlapped`` (DDP's reducer, buckets under backward) across machines,
    whose network makes the exchange long enough to hide. ``FTQ_DDP_EXCHANGE`` overrides it.

    Raises:
        PlanError: ``FTQ_DDP_EXCHANGE`` is set to something else.
    """
    forced = os.environ.get(EXCHANGE_ENV, "").strip()
    if forced:
        if forced not in (AFTER_BACKWARD, OVERLAPPED):
            raise PlanError(f"{EXCHANGE_ENV}={forced!r}: use {AFTER_BACKWARD} or {OVERLAPPED}")
        return forced
    return OVERLAPPED if int(os.environ.get("GROUP_WORLD_SIZE") or 1) > 1 else AFTER_BACKWARD


def _refuse_sharding_across_machines(sharded: bool, why: str, *, shared: bool = False) -> None:
    """A run over several machines (torchrun's ``GROUP_WORLD_SIZE``: its nnodes) must not shard
    unless its checkpoints go to a directory every machine shares (``shared``): FSDP2's
    checkpoints are written in pieces, each rank its own, and on disks the machines do not share
    no machine could resume from one.

    Raises:
        PlanError: ``sharded`` on more than one machine without a shared checkpoint directory.
    """
    machines = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    if sharded and machines > 1 and not shared:
        raise PlanError(
            f"this run spans {machines} machines and would shard the model (FSDP2: {why}); its checkpoints "
            "would be split over the machines' own disks and could not be resumed. Run it on one machine "
            "(nodes: 1, all its GPUs there), on machines sharing a checkpoint directory (FTQ_SHARED_DIR; "
            "job.json shared_checkpoint_dir), or use method lora/qlora with a base that fits one GPU"
        )


class LossModule(torch.nn.Module):
    """The model and its loss function as one module: what DDP / FSDP2 wrap.

    Called with ``model_kwargs`` instead (``Parallel.model_forward``), it is the model's own
    forward: under FSDP2 the call enters the root unit, which gathers the embeddings, final norm
    and head (and, on the run's first forward, makes itself the root), as the sampler's forwards need.
    """

    def __init__(self, model: torch.nn.Module, loss: Any) -> None:
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, batch: Any = None, meta: Any = None, num_items: int = 0, **model_kwargs: Any) -> Any:
        if model_kwargs:
            return self.model(**model_kwargs)
        return self._loss(self.model, batch, meta, num_items)


class Parallel:
    """The wrapped loss module of a run (``module``), and the gradient-sync switch."""

    def __init__(
        self,
        module: torch.nn.Module,
        strategy: str | None,
        *,
        static_graph: bool = False,
        after_backward: bool = False,
        compute_dtype: str = "float32",
    ) -> None:
        self.module = module
        self.strategy = strategy
        self.static_graph = static_graph
        self.after_backward = after_backward
        """DDP without DDP's wrapper: every backward is local and ``end_backward`` all-reduces the
        gradients once per step (``ddp_exchange``)."""
        self.compute_dtype = compute_dtype
        """The dtype FSDP2 gathers the parameters in (``apply_fsdp``)."""
        self.agreeing = False
        """Set by the OOM ladder for its window's steps (``can_agree``): every backward runs without
        the gradient exchange, and ``agree`` ends the step."""

    @property
    def can_agree(self) -> bool:
        """Whether an out-of-memory error of one rank can be retried by all: DDP without a static
        graph, whose backward can skip the exchange (``no_sync``) so that no collective is left
        half-issued when a rank stops mid-step. FSDP2 gathers parameters inside forward and
        backward (a rank that stopped would leave the others waiting in a gather), and DDP's static
        graph cannot skip an exchange."""
        return self.strategy == "ddp" and (self.after_backward or not self.static_graph)

    def end_backward(self, comm: Comm) -> None:
        """After the rank's last backward of a step (every rank calls it): end an ``agreeing`` step
        (``agree``), or exchange the gradients of an ``after_backward`` run."""
        if self.agreeing:
            self.agree(None, comm)
        elif self.after_backward:
            self.exchange(comm)

    def agree(self, failure: BaseException | None, comm: Comm) -> None:
        """End an ``agreeing`` step on every rank: raise ``torch.OutOfMemoryError`` on all of them
        when any ran out of memory (``failure`` on this one), else exchange the accumulated
        gradients once (averaged over the ranks, as DDP's own exchange does).

        The ranks meet in ``comm.gather_host`` (the host group: nothing queued on a device waits for
        it), after their last backward or at their failure, so none is left in a collective.
        """
        flat: _FlatGrads | None = None
        if failure is None:
            try:  # the exchange's buffer, before the ranks meet: running out here is a failure too
                flat = _FlatGrads(self.module)
            except torch.OutOfMemoryError as exc:
                failure = exc
        failed = [rank for rank, row in enumerate(comm.gather_host([1.0 if failure else 0.0], "oom agree")) if row[0] > 0]
        if failed:
            who = ", ".join(map(str, failed))
            detail = str(failure).splitlines()[0] if failure is not None and str(failure) else "out of memory"
            raise torch.OutOfMemoryError(f"rank {who} of {comm.world.world_size}: {detail}")
        assert flat is not None
        flat.average(comm)

    def exchange(self, comm: Comm) -> None:
        """All-reduce the trainable parameters' gradients (averaged over the ranks, as DDP's own
        exchange does) as one flat tensor: one collective a step."""
        _FlatGrads(self.module).average(comm)

    @property
    def sharded(self) -> bool:
        """The parameters are FSDP2 shards (DTensors): saving or exporting them is a collective."""
        return self.strategy == "fsdp2"

    def loss(self, batch: Any, meta: Any, num_items: int) -> torch.Tensor:
        return self.module(batch, meta, num_items)

    @property
    def gathered_dtype(self) -> torch.dtype | None:
        """Under FSDP2, the dtype a forward sees the parameters in (the shards may be fp32 masters):
        what a sampler's KV cache must hold. None otherwise (the parameters' own dtype)."""
        return getattr(torch, self.compute_dtype) if self.strategy == "fsdp2" else None

    @property
    def model_forward(self) -> Callable[..., Any] | None:
        """Under FSDP2, the model's forward through the root unit (``LossModule``'s ``model_kwargs``):
        a forward of the bare model would meet the root's parameters still sharded. None otherwise
        (call the model itself: DDP's forward would only add its bookkeeping)."""
        if self.strategy != "fsdp2":
            return None
        return lambda **model_kwargs: self.module(**model_kwargs)

    @contextmanager
    def sync(self, last: bool) -> Iterator[None]:
        """Exchange gradients in this backward only when ``last`` (the rank's last micro-batch).

        DDP with ``static_graph`` exchanges in every backward: its ``no_sync`` breaks the static
        graph's bookkeeping (an INTERNAL ASSERT, or gradients silently no longer all-reduced from
        the second iteration; pytorch/pytorch#143580). Adapters' gradients are small.
        """
        if self.after_backward:  # every backward local; ``end_backward`` exchanges once
            yield
        elif self.agreeing:  # every backward local; ``agree`` exchanges once at the step's end
            with self.module.no_sync():
                yield
        elif last or self.strategy is None or (self.strategy == "ddp" and self.static_graph):
            yield
        elif self.strategy == "ddp":
            with self.module.no_sync():
                yield
        else:  # fsdp2
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)


def parallelize(
    model: torch.nn.Module,
    loss: Any,
    decision: Decision,
    comm: Comm,
    *,
    static_graph: bool = False,
    compute_dtype: str = "float32",
) -> Parallel:
    """Wrap ``LossModule(model, loss)`` as ``decision`` says (see the module docstring).

    Args:
        static_graph: DDP's ``static_graph`` (offloaded checkpoints back-propagate each layer in
            a nested backward, which DDP accepts only for a graph it may assume static).
        compute_dtype: the plan's dtype; FSDP2 gathers the parameters in it (``apply_fsdp``).
    """
    module = LossModule(model, loss)
    if not decision.enabled:
        return Parallel(module, None)
    if decision.backend == "ddp" and ddp_exchange() == AFTER_BACKWARD:
        broadcast_trainable(module)
        return Parallel(module, "ddp", static_graph=static_graph, after_backward=True)
    if decision.backend == "ddp":
        return Parallel(apply_ddp(module, comm, static_graph=static_graph), "ddp", static_graph=static_graph)
    return Parallel(apply_fsdp(module, comm, compute_dtype), "fsdp2", compute_dtype=compute_dtype)


def apply_ddp(module: torch.nn.Module, comm: Comm, *, static_graph: bool = False) -> torch.nn.Module:
    """DDP over the trainable parameters; rank 0's adapters are broadcast once at the start.

    ``init_sync`` is off: every rank loads the same frozen base, and broadcasting it (16 GB for
    an 8B model) would only repeat what each rank read from disk.
    """
    from torch.nn.parallel import DistributedDataParallel

    broadcast_trainable(module)
    device_ids = [comm.device.index] if comm.device.type == "cuda" else None
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    # torch 2.13 renamed it (2.11, on the GPU machines, has only the old name); buffers such as
    # RoPE's inv_freq are computed alike on every rank
    no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
    return DistributedDataParallel(
        module,
        device_ids=device_ids,
        init_sync=False,
        gradient_as_bucket_view=True,
        static_graph=static_graph,
        **no_buffer_sync,
    )


def broadcast_trainable(module: torch.nn.Module) -> None:
    """Rank 0's trainable parameters (the freshly initialised adapters) to every rank."""
    import torch.distributed as dist

    for p in module.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=0)


class _FlatGrads:
    """The trainable parameters' gradients as one flat tensor (a missing one as zeros), for one
    all-reduce instead of one per tensor; ``average`` writes the result back as each ``.grad``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.flat = torch.cat([g.reshape(-1) for g in self.grads]) if self.grads else torch.empty(0)

    def average(self, comm: Comm) -> None:
        comm.all_reduce_sum(self.flat).div_(comm.world.world_size)
        offset = 0
        for p, g in zip(self.params, self.grads):
            g.copy_(self.flat[offset:offset + g.numel()].view_as(g))
            p.grad = g
            offset += g.numel()


def apply_fsdp(module: torch.nn.Module, comm: Comm, compute_dtype: str = "float32") -> torch.nn.Module:
    """FSDP2: one ``fully_shard`` unit per decoder layer, then the root (embeddings, norm, head).

    The root unit is the ``LossModule``, not the model: the fused loss reads the LM head's weight
    inside ``LossModule.forward`` without calling the head, so the head (with the embeddings and
    the final norm) must be gathered by the root's pre-forward rather than by a unit of its own
    (torchtitan gives ``[norm, output]`` one; that needs the head's own forward to run).

    Precision: the shards keep the dtype the model was loaded in (fp32 master weights for full
    fine-tuning, ``trainer.model.load.load_model``); each unit is gathered in ``compute_dtype``
    (``MixedPrecisionPolicy.param_dtype``, none when that is float32) and gradients are
    reduce-scattered in fp32, so AdamW updates the fp32 shards.

    Inputs are not cast (``cast_forward_inputs=False``): they are token ids, the packed
    metadata and the objective's fp32 extras. FSDP2's cast rebuilds every dataclass it meets
    (``torch.distributed.utils._apply_to_tensors``), so each layer got its own copy of the
    batch's ``PackedMetadata``, with a plain dict for its counter (the ``KeyError: ('varlen',
    None, device)`` of every 8B full fine-tuning on GPUs) and a cache of its own.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainer.features.offload import decoder_layers

    mesh = init_device_mesh(comm.device.type, (comm.world.world_size,))
    compute = getattr(torch, compute_dtype)
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute == torch.float32 else compute,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module
