"""One training run: the loop (``train``), a step, checkpoints and their layout, the step metrics,
the non-finite guard, evaluation and samples, and the install of a plan on the model."""
