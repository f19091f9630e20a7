"""Eval runs in the trainer: a batch generation job whose every completion is graded before its
line is written (``run.run_eval``; model graders' judges: ``judges``), and the pass rules and totals
the service reports (``results``, standard library). See docs/evals.md."""
