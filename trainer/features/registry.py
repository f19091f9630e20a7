"""Every feature, in the two orders the trainer walks them.

``PLANNED``: the order ``trainer.plan.planner.plan`` decides in; each feature reads the decisions
before it (``Context.decision``): the metadata cache its ``attention`` kernel, the activation
policy the kernel and the ``parallelism`` strategy, the offload the policy and the strategy.
``INSTALLED``: the order ``trainer.training.install.install`` applies in (and removes in reverse):
packed attention, MoE routing, the activation policy (which layers are checkpointed), the
offload (after peft, so the adapters are inside the recompute), the LoRA kernel, the fused
elementwise ops, the loss. A new feature adds its object to both (or only to ``PLANNED`` when
something else applies its decision, as the offload applies the reload).
"""

from __future__ import annotations

from trainer.features.attention import feature as attention
from trainer.features.checkpointing import policy as checkpointing
from trainer.features.fused_ops import feature as fused_ops
from trainer.features.lora_kernel import feature as lora_kernel
from trainer.features.loss import feature as loss
from trainer.features.moe import feature as moe
from trainer.features.offload import feature as offload
from trainer.parallel import strategy
from trainer.plan.feature import Feature, Installable

PLANNED: tuple[Feature, ...] = (
    attention.KERNEL,
    loss.FEATURE,
    lora_kernel.FEATURE,
    fused_ops.FEATURE,
    strategy.FEATURE,
    checkpointing.FEATURE,
    offload.FEATURE,
    offload.RELOAD_FEATURE,
    attention.CACHE,
    moe.FEATURE,
)
INSTALLED: tuple[Installable, ...] = (
    attention.CACHE,
    moe.FEATURE,
    checkpointing.FEATURE,
    offload.FEATURE,
    lora_kernel.FEATURE,
    fused_ops.FEATURE,
    loss.FEATURE,
)
