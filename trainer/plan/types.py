"""The plan's types: ``ModelFacts`` (what the plan reads of a model), ``Decision`` (one
optimization or kernel choice) and ``Plan`` (every decision of a run, the ``plan`` event).

Types only: ``trainer.plan.planner.plan`` makes them, each feature of ``trainer.features``
decides one ``Decision`` and applies it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainer.plan.memory import Shape


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about the model, read from its config before loading weights.

    ``trainer.model.load.model_facts`` fills it from the real config; the defaults describe a plain
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
    """Why ``trainer.features.loss.fused`` cannot stand in for the LM head + loss, or None."""
    num_layers: int | None = None
    """Decoder layers (the activation estimate for ``offload_activations``); None when unknown."""
    hidden_size: int | None = None
    param_count: int | None = None
    """Parameters of the base model (its weights' GPU memory); None when unknown."""
    moe_blocks: int = 0
    """Experts modules ``trainer.features.moe.routing`` recognises (0 for a dense model)."""
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
