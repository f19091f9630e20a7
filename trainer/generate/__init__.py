"""Text generation: greedy sample generations at checkpoints (``samples``)."""
