"""Packed attention: its two decisions and install (``feature``), the ``ftq_packed`` attention
(``packed``) over the per-backend calls (``backends``), and the float64 reference (``reference``).
The Triton kernel is ``trainer.kernels.attention``; the metadata is ``trainer.data.packed_metadata``."""
