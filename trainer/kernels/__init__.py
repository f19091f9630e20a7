"""Triton kernels for the trainer's hot paths, each with a plain-PyTorch reference.

Importing this package imports torch only; Triton is imported by ``flash_varlen`` when it is
installed, and ``supported`` says why a kernel cannot run when it is not.
"""

from trainer.kernels.attention import SUPPORTED_HEAD_DIMS, flash_varlen_attention, supported
from trainer.features.attention.reference import reference_varlen_attention

__all__ = ["SUPPORTED_HEAD_DIMS", "flash_varlen_attention", "reference_varlen_attention", "supported"]
