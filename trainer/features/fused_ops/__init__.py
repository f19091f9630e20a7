"""Fused RMSNorm / SwiGLU / RoPE: the decision and install (``feature``), the module patches
(``patch``). The Triton kernels are ``trainer.kernels.rmsnorm``, ``swiglu`` and ``rope``."""
