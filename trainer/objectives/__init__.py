"""Training objectives: each a loss and a batch shape on the one packed path, picked by name.

An objective is a declaration (``registry.Declaration``: name, record formats, step fields and
their charts, spec section; standard library only, so the worker, ``core`` and ``api`` read it
without torch) and an implementation (``base.Objective``: loads its records, builds its loss,
sums its step statistics on the device and turns them into its step fields one step late),
imported only when a run needs it (``registry.load``). The loop, the step and the checkpoint
code call the implementation's hooks and never name an objective.

Built in: ``sft`` (``sft.py``: token cross-entropy, token accuracy) and ``dpo`` (``dpo.py`` on
``preference.py`` and ``fused_logprobs.py``). A new objective: a module with its declaration
(``register``) and its ``Objective``; see docs/architecture.md, "where does a new objective go".
"""

from trainer.objectives import declarations as _declarations  # noqa: F401  # registers the built-ins
from trainer.objectives.registry import (
    Chart,
    Declaration,
    MetricField,
    declaration,
    declarations,
    for_openai_method,
    formats,
    load,
    metric_fields,
    metric_names,
    names,
    register,
    sections,
    unregister,
)

__all__ = [
    "Chart", "Declaration", "MetricField", "declaration", "declarations", "for_openai_method", "formats", "load", "metric_fields",
    "metric_names", "names", "register", "sections", "unregister",
]
