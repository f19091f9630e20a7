"""Grouped MoE routing: its decision and install (``feature``), the routing (``routing``) and the
per-layer metadata it builds (``metadata``). The Triton kernels are ``trainer.kernels.moe``."""
