"""Triton kernels for the trainer's hot paths, one module per op, each with a plain-PyTorch path:
``attention`` (varlen flash attention), ``cross_entropy``, ``moe`` (gate, dispatch, combine),
``rmsnorm``, ``rope``, ``swiglu``. The feature that decides and installs each lives in
``trainer.features`` (the float64 attention reference: ``trainer.features.attention.reference``).

Importing this package imports nothing; a kernel module imports Triton when it is installed,
and ``supported`` says why a kernel cannot run when it is not.
"""
