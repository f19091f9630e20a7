"""Which optimizations a run uses: ``plan(hardware, config, facts) -> Plan``.

A pure function from three facts: the machine (``trainer.hardware.Hardware``), the job
(``TrainConfig``: method, switches, token budget) and the model (``ModelFacts``, read from its
config before any weight is loaded). It asks each feature of ``trainer.features`` to decide for
itself; every feature answers ``supported(hardware, facts)`` (why it can never run here, or
None) and turns the job's switch into one ``Decision``. Rules for every switch:

- ``off``  -> disabled, reason "off in the job".
- ``auto`` -> enabled when it can run here; otherwise disabled with the reason.
- ``on``   -> enabled, or ``PlanError`` before any training, naming the hardware and the fix.

Kernel choices without a switch (``attention``, ``loss``, ``lora_kernel``, ``fused_ops``) and
the multi-rank strategy (``parallelism``) are decisions too, with ``requested="auto"``. The
activation policy (``gradient_checkpointing``: ``auto | on | off | selective``) follows them,
chosen from the memory estimate (``trainer.memory``) against the GPU's free memory at start
(``free_gpu_bytes``) or the job's ``max_gpu_memory_gb`` (``trainer.features.checkpointing``). ``trainer.install.install(model, plan)`` applies the
plan; the plan event and ``python -m trainer detect`` show it (``Plan.to_dict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer.config import SWITCHES, TrainConfig
from trainer.errors import PlanError
from trainer.hardware import Hardware
from trainer.memory import Shape


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about the model, read from its config before loading weights.

    ``trainer.model.model_facts`` fills it from the real config; the defaults describe a plain
    causal LM that every kernel can run (what ``detect`` plans for when no job is given).
    """

    model_type: str
    is_moe: bool = False
    supports_sdpa: bool = True
    packed_attention: str | None = None
    """Why ``ftq_packed`` attention cannot run this model (soft-capping, bidirectional), or None."""
    head_dim: int | None = None
    """Attention head dim (our Triton kernel supports 64 and 128); None when unknown."""
    sliding_window: bool = False
    """Some layer attends through a sliding window (Mistral, GPT-OSS)."""
    attention_sinks: bool = False
    """Attention sinks (GPT-OSS): the kernel must return the log-sum-exp."""
    grouped_query: bool = False
    """Fewer key/value heads than query heads (GQA): torch's varlen_attn needs ``enable_gqa``."""
    fused_loss: str | None = None
    """Why ``trainer.fused_loss`` cannot stand in for the LM head + loss, or None."""
    num_layers: int | None = None
    """Decoder layers (the activation estimate for ``offload_activations``); None when unknown."""
    hidden_size: int | None = None
    param_count: int | None = None
    """Parameters of the base model (its weights' GPU memory); None when unknown."""
    moe_blocks: int = 0
    """Experts modules ``trainer.moe_routing`` recognises (0 for a dense model)."""
    moe_family: str | None = None
    """``gpt_oss``, ``qwen3_moe``, ``mixtral`` or the experts class name."""
    moe_routing: str | None = None
    """Why grouped routing cannot run this MoE model (quantized or custom experts), or None."""
    shape: Shape | None = None
    """The sizes the activation policy's memory estimate reads; None when the config lacks one."""


ANY_MODEL = ModelFacts(model_type="any model", is_moe=True, moe_blocks=1)
"""The facts ``capabilities`` plans with: a model with MoE blocks that every kernel can run, so a
switch is reported impossible only for reasons of the machine or of this build."""


@dataclass(frozen=True)
class Decision:
    """One optimization or kernel choice, as the plan event carries it."""

    name: str
    requested: str
    """The job's value for a switch (``auto``/``on``/``off``); ``auto`` for a kernel choice."""
    enabled: bool
    backend: str | None
    """What runs: a kernel or mode name (``torch_varlen``, ``grouped_mm``, ``double``), or None."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str
    """Compute dtype: ``bfloat16`` on a bf16-capable GPU, else ``float32`` (or the job's)."""
    decisions: tuple[Decision, ...]
    """``attention``, ``loss``, ``lora_kernel``, ``fused_ops``, ``parallelism``,
    ``gradient_checkpointing``, then one per switch."""
    hf_attention: str = "sdpa"
    """The model's own attention implementation at load (``sdpa``, or ``eager`` where it has none);
    packed attention (``ftq_packed``) is installed over it afterwards."""

    def decision(self, name: str) -> Decision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(f"no decision named {name!r}; have {[d.name for d in self.decisions]}")

    @property
    def attention_backend(self) -> str:
        backend = self.decision("attention").backend
        assert backend is not None, "the attention decision always names a backend"
        return backend

    @property
    def loss_kernel(self) -> str:
        backend = self.decision("loss").backend
        assert backend is not None, "the loss decision always names a kernel"
        return backend

    def to_dict(self) -> dict[str, Any]:
        """The plan event's fields (and ``trainer detect --json``'s ``plan``)."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "model_attention": self.hf_attention,
            "decisions": [d.to_dict() for d in self.decisions],
        }


def plan(
    hw: Hardware, config: TrainConfig, facts: ModelFacts | None = None, world_size: int = 1,
    free_gpu_bytes: int | None = None,
) -> Plan:
    """Decide every optimization and kernel for a run (see the module docstring for the rules).

    ``world_size`` ranks (torchrun) add the ``parallelism`` decision's strategy (DDP or FSDP2,
    ``trainer.parallel``); FSDP2 runs without offload. ``free_gpu_bytes``: the GPU's free memory
    at start (``trainer.memory.free_gpu_bytes``); None plans for the whole ``hw.gpu_memory``.

    Raises:
        PlanError: a switch is ``on`` but cannot run here, or ``method`` needs what is missing.
    """
    from trainer import parallel
    from trainer.features import attention, checkpointing, fused_ops, lora_kernel, loss, moe, offload

    facts = facts or ModelFacts(model_type="unknown")
    if config.method == "qlora" and not (hw.device == "cuda" and hw.bitsandbytes):
        raise PlanError(
            f"method=qlora needs a CUDA GPU with bitsandbytes installed; this machine is {hw.describe()}"
            f"{'' if hw.bitsandbytes else ' without bitsandbytes'}. Use method=lora, or install bitsandbytes on a GPU worker"
        )
    dtype = compute_dtype(hw, config)
    opts = config.optimizations
    kernel = attention.choose(hw, facts)
    strategy = parallel.decide(hw, config, facts, world_size, dtype)
    sharded = strategy.backend == "fsdp2"
    _refuse_sharding_across_machines(sharded, strategy.reason)
    policy, estimated = checkpointing.decide(
        config.gradient_checkpointing, hw, config, facts, dtype, world_size=world_size, sharded=sharded,
        packed_attention=kernel.enabled, free_bytes=free_gpu_bytes,
        offload_missing=offload.policy_unavailable(hw, config, facts, dtype, sharded),
    )
    offloaded, reload = offload.decide(
        opts.offload_activations, opts.double_buffered_reload, hw, config, facts, dtype,
        sharded=sharded, policy=policy if estimated else None,
    )
    switches = {
        "packed_metadata_cache": attention.decide_cache(opts.packed_metadata_cache, hw, facts, kernel),
        "double_buffered_reload": reload,
        "moe_grouped_routing": moe.decide(opts.moe_grouped_routing, hw, config, facts, dtype),
        "offload_activations": offloaded,
    }
    assert set(switches) == set(SWITCHES), f"plan decides {sorted(switches)}, the config has {SWITCHES}"
    return Plan(
        device=hw.device,
        dtype=dtype,
        decisions=(
            kernel,
            loss.decide(hw, facts),
            lora_kernel.decide(hw, config),
            fused_ops.decide(hw, facts),
            strategy,
            policy,
            *(switches[name] for name in SWITCHES),
        ),
        hf_attention="sdpa" if facts.supports_sdpa else "eager",
    )


def capabilities(hw: Hardware, config: TrainConfig) -> dict[str, str | None]:
    """Per switch: None when ``on`` can be honoured on ``hw`` (for a model every kernel can run),
    else the one-line reason it cannot. What ``detect --json`` reports and the API checks."""
    from trainer.features import attention, moe, offload

    answers = {
        "packed_metadata_cache": attention.supported(hw, ANY_MODEL),
        "double_buffered_reload": offload.reload_unavailable_for(hw, config, ANY_MODEL),
        "moe_grouped_routing": moe.supported(hw, ANY_MODEL),
        "offload_activations": offload.unavailable_for(hw, config, ANY_MODEL),
    }
    return {name: answers[name] for name in SWITCHES}


def compute_dtype(hw: Hardware, config: TrainConfig) -> str:
    """The job's ``model.dtype``, or bf16 on a bf16-capable GPU and fp32 elsewhere."""
    if config.model.dtype != "auto":
        return config.model.dtype
    return "bfloat16" if hw.device == "cuda" and hw.bf16 else "float32"


def _refuse_sharding_across_machines(sharded: bool, why: str) -> None:
    """A run over several machines (torchrun's ``GROUP_WORLD_SIZE``: its nnodes) must not shard:
    FSDP2's checkpoints are written in pieces, each machine's on its own disk, and a machine
    shares no disk with the others, so no machine could resume from one.

    Raises:
        PlanError: ``sharded`` on more than one machine.
    """
    import os

    machines = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    if sharded and machines > 1:
        raise PlanError(
            f"this run spans {machines} machines and would shard the model (FSDP2: {why}); its checkpoints "
            "would be split over the machines' own disks and could not be resumed. Run it on one machine "
            "(nodes: 1, all its GPUs there), or use method lora/qlora with a base that fits one GPU"
        )

