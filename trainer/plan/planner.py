"""Which optimizations a run uses: ``plan(hardware, config, facts) -> Plan``.

A pure function from three facts: the machine (``trainer.plan.hardware.Hardware``), the job
(``TrainConfig``: method, switches, token budget; read once into a ``Job``) and the model
(``ModelFacts``, read from its config before any weight is loaded). It asks each feature of
``trainer.features.registry.PLANNED`` in turn to decide for itself from one ``Context``
(``trainer.plan.feature``), which carries the decisions made so far. Rules for every switch:

- ``off``  -> disabled, reason "off in the job".
- ``auto`` -> enabled when it can run here; otherwise disabled with the reason.
- ``on``   -> enabled, or ``PlanError`` before any training, naming the hardware and the fix.

Kernel choices without a switch (``attention``, ``loss``, ``lora_kernel``, ``fused_ops``) and
the multi-rank strategy (``parallelism``) are decisions too, with ``requested="auto"``. The
activation policy (``gradient_checkpointing``: ``auto | on | off | selective``) follows them,
chosen from the memory estimate (``trainer.plan.memory``) against the GPU's free memory at start
(``free_gpu_bytes``) or the job's ``max_gpu_memory_gb`` (``trainer.features.checkpointing.policy``).
The plan lists the decisions that are not switches in the order they were made, then one per
switch in ``SWITCHES`` order. ``trainer.training.install.install(model, plan)`` applies the plan; the
plan event and ``python -m trainer detect`` show it (``Plan.to_dict``).
"""

from __future__ import annotations

from trainer.config import SWITCHES, TrainConfig
from trainer.errors import PlanError
from trainer.features.registry import PLANNED
from trainer.plan.feature import Context, Job
from trainer.plan.hardware import Hardware
from trainer.plan.types import ANY_MODEL, ModelFacts, Plan


def plan(
    hw: Hardware, config: TrainConfig, facts: ModelFacts | None = None, world_size: int = 1,
    free_gpu_bytes: int | None = None,
) -> Plan:
    """Decide every optimization and kernel for a run (see the module docstring for the rules).

    ``world_size`` ranks (torchrun) add the ``parallelism`` decision's strategy (DDP or FSDP2,
    ``trainer.parallel.strategy``); FSDP2 runs without offload. ``free_gpu_bytes``: the GPU's free
    memory at start (``trainer.plan.memory.free_gpu_bytes``); None plans for the whole ``hw.gpu_memory``.

    Raises:
        PlanError: a switch is ``on`` but cannot run here, or ``method`` needs what is missing.
    """
    facts = facts or ModelFacts(model_type="unknown")
    if config.method == "qlora" and not (hw.device == "cuda" and hw.bitsandbytes):
        raise PlanError(
            f"method=qlora needs a CUDA GPU with bitsandbytes installed; this machine is {hw.describe()}"
            f"{'' if hw.bitsandbytes else ' without bitsandbytes'}. Use method=lora, or install bitsandbytes on a GPU worker"
        )
    dtype = compute_dtype(hw, config)
    ctx = Context(hw, facts, Job.of(config), dtype, world_size, free_gpu_bytes)
    for feature in PLANNED:
        decision = feature.decide(ctx)
        assert decision.name == feature.name, f"{feature.name} decided {decision.name}"
        ctx = ctx.with_decision(decision)
    decided = {d.name for d in ctx.decided}
    assert set(SWITCHES) <= decided, f"plan decides {sorted(decided)}, the config has {SWITCHES}"
    return Plan(
        device=hw.device,
        dtype=dtype,
        decisions=(
            *(d for d in ctx.decided if d.name not in SWITCHES),
            *(ctx.decision(name) for name in SWITCHES),
        ),
        hf_attention="sdpa" if facts.supports_sdpa else "eager",
    )


def capabilities(hw: Hardware, config: TrainConfig) -> dict[str, str | None]:
    """Per switch: None when ``on`` can be honoured on ``hw`` (for a model every kernel can run),
    else the one-line reason it cannot. What ``detect --json`` reports and the API checks."""
    ctx = Context(hw, ANY_MODEL, Job.of(config), compute_dtype(hw, config))
    answers = {feature.name: feature.supported(ctx) for feature in PLANNED}
    return {name: answers[name] for name in SWITCHES}


def compute_dtype(hw: Hardware, config: TrainConfig) -> str:
    """The job's ``model.dtype``, or bf16 on a bf16-capable GPU and fp32 elsewhere."""
    if config.model.dtype != "auto":
        return config.model.dtype
    return "bfloat16" if hw.device == "cuda" and hw.bf16 else "float32"
