"""GPU benchmarks: scripts that print tables (python -m bench.attention, python -m bench.train_step)."""
