"""Which optimizations a run uses: ``plan(hardware, config, facts) -> Plan``.

A pure function from three facts: the machine (``trainer.plan.hardware.Hardware``), the job
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
chosen from the memory estimate (``trainer.plan.memory``) against the GPU's free memory at start
(``free_gpu_bytes``) or the job's ``max_gpu_memory_gb`` (``trainer.features.checkpointing.policy``). ``trainer.run.install.install(model, plan)`` applies the
plan; the plan event and ``python -m trainer detect`` show it (``Plan.to_dict``).
"""

from __future__ import annotations

from trainer.config import SWITCHES, TrainConfig
from trainer.errors import PlanError
from trainer.plan.hardware import Hardware
from trainer.plan.types import ANY_MODEL, Decision, ModelFacts, Plan


def plan(
    hw: Hardware, config: TrainConfig, facts: ModelFacts | None = None, world_size: int = 1,
    free_gpu_bytes: int | None = None,
) -> Plan:
    """Decide every optimization and kernel for a run (see the module docstring for the rules).

    ``world_size`` ranks (torchrun) add the ``parallelism`` decision's strategy (DDP or FSDP2,
    ``trainer.parallel.strategy``); FSDP2 runs without offload. ``free_gpu_bytes``: the GPU's free memory
    at start (``trainer.plan.memory.free_gpu_bytes``); None plans for the whole ``hw.gpu_memory``.

    Raises:
        PlanError: a switch is ``on`` but cannot run here, or ``method`` needs what is missing.
    """
    from trainer.parallel import strategy as parallel
    from trainer.features.attention import feature as attention
    from trainer.features.checkpointing import policy as checkpointing
    from trainer.features.fused_ops import feature as fused_ops
    from trainer.features.lora_kernel import feature as lora_kernel
    from trainer.features.loss import feature as loss
    from trainer.features.moe import feature as moe
    from trainer.features.offload import feature as offload

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
    from trainer.features.attention import feature as attention
    from trainer.features.moe import feature as moe
    from trainer.features.offload import feature as offload

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

