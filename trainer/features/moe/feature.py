"""MoE routing grouped by one argsort + bincount (``trainer.features.moe.routing``), or transformers' eager loop.

On for every recognised experts module. The backend is what ``trainer.features.moe.routing.install``
picks: ``grouped_mm`` (no host sync) for bf16 weights on a CUDA GPU of sm80+, else the
per-expert-slice ``loop`` (one host sync per layer); its Triton combine/gate kernels only on CUDA
with Triton. ``off`` patches the experts to transformers' eager per-expert loop (the honest
"before", whatever ``config._experts_implementation`` says); ``on`` for a dense model is a
``PlanError``.
"""

from __future__ import annotations

import torch

from trainer.features.moe import routing as moe_routing
from trainer.plan.feature import Context, Target, how, unavailable
from trainer.plan.hardware import Hardware
from trainer.plan.types import Decision, ModelFacts

NAME = "moe_grouped_routing"


def supported(hw: Hardware, facts: ModelFacts) -> str | None:
    """Why grouped routing cannot run this model (it runs on any machine), or None."""
    if not facts.is_moe:
        return f"no MoE blocks in this model ({facts.model_type})"
    return facts.moe_routing


class MoeHandle:
    """Experts modules patched by ``moe_routing.install``; ``remove`` restores each instance."""

    def __init__(self, model: torch.nn.Module, enabled: bool) -> None:
        modules = [module for _, module in moe_routing.experts_modules(model)]
        self._saved = [(m, {k: vars(m)[k] for k in moe_routing.INSTANCE_STATE if k in vars(m)}) for m in modules]
        self.result = moe_routing.install(model, enabled, triton=None if enabled else False)

    def remove(self) -> None:
        for module, saved in self._saved:
            for key in moe_routing.INSTANCE_STATE:
                vars(module).pop(key, None)
            vars(module).update(saved)
        self._saved = []

    def describe(self) -> str:
        return f"MoE routing: {self.result.describe()}"


class NoExperts:
    """The twin for a dense model: nothing to route."""

    def remove(self) -> None:
        pass

    def describe(self) -> None:
        return None


def _decide(ctx: Context) -> Decision:
    """The ``moe_grouped_routing`` decision (see the module docstring)."""
    requested, hw, facts = ctx.job.switch(NAME), ctx.hw, ctx.facts
    if requested == "off":
        if facts.is_moe and facts.moe_blocks:
            return Decision(
                NAME, "off", False, "eager",
                f"off in the job: transformers' eager per-expert loop on {facts.moe_blocks} MoE blocks",
            )
        return Decision(NAME, "off", False, None, "off in the job")
    missing = supported(hw, facts)
    if missing is not None:
        return unavailable(NAME, requested, missing, hw)
    grouped = (
        hw.device == "cuda"
        and hw.capability is not None
        and hw.capability >= (8, 0)
        and ctx.dtype == "bfloat16"
        and ctx.job.method != "qlora"
    )
    what = (
        "grouped_mm"
        if grouped
        else "per-expert slices, one host sync per layer (grouped_mm needs bf16 on a CUDA GPU of sm80+)"
    )
    if hw.device == "cuda" and hw.triton:
        what += ", Triton combine + gate"
    family = f" ({facts.moe_family})" if facts.moe_family else ""
    return Decision(
        NAME, requested, True, "grouped_mm" if grouped else "loop",
        f"{how(requested)}: grouped routing on {facts.moe_blocks or 'every'} MoE blocks{family}, {what}",
    )


class MoeRouting:
    """The ``moe_grouped_routing`` switch: grouped routing or the eager loop on every experts module."""

    name = NAME

    def supported(self, ctx: Context) -> str | None:
        return supported(ctx.hw, ctx.facts)

    def decide(self, ctx: Context) -> Decision:
        return _decide(ctx)

    def apply(self, model: torch.nn.Module, decision: Decision, target: Target) -> MoeHandle | NoExperts:
        """Grouped routing (enabled) or transformers' eager loop on every recognised experts module.

        Expert LoRA (peft ``target_parameters``) is read through the same forward.
        """
        if not moe_routing.experts_modules(model):
            return NoExperts()
        return MoeHandle(model, decision.enabled)


FEATURE = MoeRouting()
