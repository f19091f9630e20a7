"""The loss kernel: its decision and install (``feature``), the fused chunked LM head + cross-entropy
(``fused``) and the packed forward that calls the model (``packed_forward``). The Triton kernel is
``trainer.kernels.cross_entropy``."""
