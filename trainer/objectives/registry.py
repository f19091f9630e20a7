"""What an objective declares, and the one registry of them. Standard library only.

A declaration is everything other processes need to know of a training method without torch:
its name (the job spec's ``objective``), the record formats it trains on (``data.format``), the
fields it adds to the ``step`` event (``MetricField``, with the dashboard's charts of them), its
spec section (a frozen dataclass, e.g. ``DpoConfig``: the job spec's and ``job.json``'s
``<name>`` key) and where its implementation lives (imported on first use, ``load``).

Readers: ``trainer.config`` (objective and format checks, the section's key in ``job.json``),
``trainer.events`` (the step fields), ``core.jobs.spec`` (the ``objective`` values, the section's
schema), ``api.jobs.schemas.MetricOut`` and the dashboard's charts (through the API's schema), the
worker's store of step rows and its trackers. ``trainer.objectives.declarations`` registers the
built-in ones (``sft``, ``dpo``); anything else registers its own with ``register``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MetricField:
    """One field an objective adds to the ``step`` event (a float; null for other objectives)."""

    name: str
    """The step event's key (and ``MetricOut``'s field, the chart series' key, the trackers' ``train/<name>``)."""
    label: str
    """The chart legend's word for it."""
    unit: str
    """What it counts, for people: ``fraction``, ``nats``, ``reward`` ..."""
    doc: str
    """One line: what the value is, for the API's schema."""


@dataclass(frozen=True)
class Chart:
    """One dashboard chart of an objective's step fields, shown on its jobs' pages."""

    id: str
    """The chart's ``data-testid`` is ``chart-<id>``."""
    title: str
    fields: tuple[str, ...]
    """Names of the objective's ``MetricField``s drawn, one series each."""
    digits: int = 3
    """Significant digits of the values shown."""


@dataclass(frozen=True)
class Declaration:
    """A training method as the service sees it (its torch side: ``trainer.objectives.base.Objective``)."""

    name: str
    """The job spec's ``objective`` value."""
    title: str
    """Its name for people (``DPO``)."""
    formats: tuple[str, ...]
    """The ``data.format`` values it trains on (``core.files.validate`` names them at upload)."""
    implementation: str | Callable[[], Any]
    """``module:Class`` of its ``Objective``, imported on first use; or a factory."""
    doc: str = ""
    """One line for the job spec's ``objective`` description."""
    metrics: tuple[MetricField, ...] = ()
    charts: tuple[Chart, ...] = ()
    section: type | None = None
    """Its settings (a frozen stdlib dataclass, defaults filled in), under the key ``name`` in the
    job spec and ``job.json``; each field's ``metadata`` carries ``doc`` and the spec's bounds."""
    fsdp2: bool = True
    """Whether it runs when the model is sharded with FSDP2 (several GPUs for ``method: full``)."""
    openai_method: str | None = None
    """The OpenAI fine-tuning ``method.type`` it serves (``supervised``, ``dpo``); None: none."""

    def __post_init__(self) -> None:
        names = [m.name for m in self.metrics]
        charted = [name for chart in self.charts for name in chart.fields]
        if sorted(charted) != sorted(names):
            raise ValueError(f"objective {self.name}: its charts must draw each metric field once "
                             f"(fields {names}, charted {charted})")
        if self.section is not None and not dataclasses.is_dataclass(self.section):
            raise ValueError(f"objective {self.name}: section must be a dataclass, got {self.section!r}")


_REGISTRY: dict[str, Declaration] = {}


def register(declaration: Declaration) -> Declaration:
    """Add ``declaration`` (returned); its metric names must be new to the step event.

    Raises:
        ValueError: its name is taken, or a metric field is another objective's.
    """
    if declaration.name in _REGISTRY:
        raise ValueError(f"objective {declaration.name!r} is registered already")
    taken = {m.name: d.name for d in _REGISTRY.values() for m in d.metrics}
    for metric in declaration.metrics:
        if metric.name in taken:
            raise ValueError(f"objective {declaration.name}: step field {metric.name!r} is objective "
                             f"{taken[metric.name]}'s; name it differently")
    _REGISTRY[declaration.name] = declaration
    return declaration


def unregister(name: str) -> None:
    """Remove a registered objective (tests that register their own)."""
    _REGISTRY.pop(name, None)


def declarations() -> tuple[Declaration, ...]:
    """Every registered objective, in registration order (the built-ins first)."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def declaration(name: str) -> Declaration:
    """Raises: ValueError: no objective of that name (the message lists them)."""
    if name not in _REGISTRY:
        raise ValueError(f"objective: {name!r} is not one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def metric_fields() -> tuple[MetricField, ...]:
    """Every objective's step fields, objective by objective: each ``step`` event carries them all."""
    return tuple(m for d in _REGISTRY.values() for m in d.metrics)


def metric_names() -> tuple[str, ...]:
    return tuple(m.name for m in metric_fields())


def for_openai_method(method: str) -> Declaration | None:
    """The objective that serves OpenAI's ``method.type`` ``method``, if one does."""
    return next((d for d in _REGISTRY.values() if d.openai_method == method), None)


def formats() -> tuple[str, ...]:
    """Every record format some objective trains on."""
    return tuple(dict.fromkeys(f for d in _REGISTRY.values() for f in d.formats))


def sections() -> dict[str, type]:
    """Objective name -> its section's dataclass, for the objectives that have one."""
    return {d.name: d.section for d in _REGISTRY.values() if d.section is not None}


def load(name: str) -> Any:
    """A new instance of ``name``'s ``Objective`` (its module imported now: torch comes in here)."""
    implementation = declaration(name).implementation
    if callable(implementation):
        return implementation()
    module, _, attr = implementation.partition(":")
    return getattr(importlib.import_module(module), attr)()
