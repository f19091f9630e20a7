"""What every feature module shares: the handle protocol and the switch rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from trainer.errors import PlanError
from trainer.plan.hardware import Hardware
from trainer.plan.types import Decision


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
