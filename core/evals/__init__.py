"""Evals: a data source schema and testing criteria (``service``), run on a model as a queued job
of kind ``eval`` (``runs``), their results read from the run's graded lines (``results``). See docs/evals.md."""
