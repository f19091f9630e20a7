"""The ``Feature`` protocol every optimization implements, and what its methods are given.

A feature makes one decision and (when it installs something) applies it:

- ``supported(ctx) -> None | reason``: why it can never run for this job here (``capabilities``
  asks it with a model every kernel can run);
- ``decide(ctx) -> Decision``: the job's switch (or ``auto`` for a kernel choice) turned into a
  decision with a reason; ``on`` that cannot run raises ``PlanError`` naming the hardware and
  the fix. ``ctx`` is one frozen ``Context``: the machine, the model's facts, what the job asks
  (``Job``, read once from the ``TrainConfig``) and the decisions made before this one, in the
  order ``trainer.features.registry.PLANNED`` lists them;
- ``apply(model, decision, target) -> Handle`` (``Installable`` only): installs the decision on
  a loaded model; the handle's ``remove()`` puts the model, and any module-level function it
  patched, back exactly.

Partner decisions: a feature whose decision depends on another's reads it from ``ctx.decision``
(the metadata cache reads the ``attention`` kernel, the reload reads nothing the offload does not
also compute) and the applied decision carries the partner's choice in its ``backend``, so each
``apply`` reads only its own decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainer.errors import PlanError
from trainer.plan.hardware import Hardware
from trainer.plan.types import Decision, ModelFacts

if TYPE_CHECKING:
    from trainer.config import TrainConfig


@dataclass(frozen=True)
class Job:
    """What of the job the features read: its switches and the few values they decide from."""

    method: str
    switches: tuple[tuple[str, str], ...]
    """``(name, auto | on | off)`` for every switch of ``trainer.config.Optimizations``."""
    gradient_checkpointing: str
    """The activation policy asked for: ``auto | on | off | selective``."""
    lora_r: int
    lora_dropout: float
    batch_tokens: int
    max_seq_len: int
    max_gpu_memory_gb: float | None
    shared_checkpoints: bool = False
    """Whether every machine of the run writes its checkpoints into one shared directory
    (``TrainConfig.shared_checkpoint_dir``): then a sharded run may span machines."""

    @classmethod
    def of(cls, config: TrainConfig) -> Job:
        return cls(
            method=config.method,
            switches=tuple(
                (f.name, getattr(config.optimizations, f.name)) for f in dataclasses.fields(config.optimizations)
            ),
            gradient_checkpointing=config.gradient_checkpointing,
            lora_r=config.lora.r,
            lora_dropout=config.lora.dropout,
            batch_tokens=config.data.batch_tokens,
            max_seq_len=config.data.max_seq_len,
            max_gpu_memory_gb=config.max_gpu_memory_gb,
            shared_checkpoints=config.shared_checkpoint_dir is not None,
        )

    def switch(self, name: str) -> str:
        """The job's value of switch ``name`` (``auto``, ``on`` or ``off``)."""
        return dict(self.switches)[name]


@dataclass(frozen=True)
class Context:
    """Everything a feature decides from: one value, the same for every feature."""

    hw: Hardware
    facts: ModelFacts
    job: Job
    dtype: str
    """The compute dtype (``trainer.plan.planner.compute_dtype``)."""
    world_size: int = 1
    free_gpu_bytes: int | None = None
    """The GPU's free memory at start; None plans for the whole ``hw.gpu_memory``."""
    decided: tuple[Decision, ...] = ()
    """The decisions made before this feature's, in decide order."""

    def decision(self, name: str) -> Decision:
        for d in self.decided:
            if d.name == name:
                return d
        raise KeyError(f"{name!r} is not decided yet; decided: {[d.name for d in self.decided]}")

    def with_decision(self, decision: Decision) -> Context:
        return dataclasses.replace(self, decided=(*self.decided, decision))


@dataclass(frozen=True)
class Target:
    """Where ``apply`` installs: the plan's device (None: the model's) and, for tests only, the
    activation budget probe (``trainer.features.checkpointing.policy``)."""

    device: str | None = None
    activation_budget: int | None = None


class Feature(Protocol):
    """One optimization or kernel choice: one decision (see the module docstring)."""

    name: str
    """The decision's name: a switch of ``trainer.config.Optimizations``, or a kernel choice."""

    def supported(self, ctx: Context) -> str | None:
        """Why it can never run for this job on this machine and model, or None."""

    def decide(self, ctx: Context) -> Decision:
        """This feature's decision, from ``ctx`` (``PlanError`` for ``on`` that cannot run)."""


class Installable(Feature, Protocol):
    """A feature that installs its decision on a loaded model."""

    def apply(self, model: Any, decision: Decision, target: Target) -> Handle:
        """Install what ``decision`` says on ``model`` (a no-op handle when it says nothing)."""


class Handle(Protocol):
    """What ``apply`` returns."""

    def remove(self) -> None:
        """Put the model (and any module-level function) back as it was before ``apply``."""

    def describe(self) -> str | None:
        """One line for the run's log; None when nothing was installed."""


@dataclass
class Undo:
    """A handle made of a log line and the callable that undoes the install (run once)."""

    description: str | None = None
    undo: Callable[[], None] = field(default=lambda: None)

    def remove(self) -> None:
        undo, self.undo = self.undo, lambda: None
        undo()

    def describe(self) -> str | None:
        return self.description


def how(requested: str) -> str:
    """How a decision was reached, for its reason: ``on in the job`` or ``auto``."""
    return "on in the job" if requested == "on" else "auto"


def unavailable(
    name: str, requested: str, why: str, hw: Hardware, backend: str | None = None
) -> Decision:
    """``name`` cannot run (``why``): disabled under ``auto``, ``PlanError`` under ``on``."""
    if requested == "on":
        raise PlanError(
            f"{name}=on cannot run: {why} (machine: {hw.describe()}). Set {name} to auto or off"
        )
    return Decision(name, requested, False, backend, why)


def off(name: str, backend: str | None = None, why: str = "off in the job") -> Decision:
    return Decision(name, "off", False, backend, why)
