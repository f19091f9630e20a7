"""What a trainer process need not import.

peft imports bitsandbytes whenever it is installed (``peft.helpers`` → ``peft.tuners.lora.bnb``),
and bitsandbytes imports ``torch._inductor`` at import time: 1.3 s of CPU in a trainer's start on
a 2-core CPU box (``python -X importtime``, a tiny LoRA job: 6.0 s of user time with it, 4.7 s
without), in every job, although only QLoRA uses it. ``skip_bitsandbytes`` marks the module absent
for the process (``sys.modules[name] = None``: ``importlib.util.find_spec`` then answers None, so
peft's and transformers' availability checks say no and nothing imports it), in a process that
loads no 4-bit model: ``trainer run`` of a method other than ``qlora``, ``trainer generate``
(which loads bases in bf16). Whether it is installed is still read from its distribution's metadata
(``installed``), which the hardware facts use, so a job's recorded hardware stays true.
"""

from __future__ import annotations

import importlib.metadata
import sys

BITSANDBYTES = "bitsandbytes"


def skip_bitsandbytes(quantized: bool) -> bool:
    """Mark bitsandbytes absent in this process unless it loads a ``quantized`` (4-bit) model or
    bitsandbytes is already imported; True when it was marked."""
    if quantized or sys.modules.get(BITSANDBYTES) is not None:
        return False
    sys.modules[BITSANDBYTES] = None  # type: ignore[assignment]
    return True


def installed(distribution: str) -> bool:
    """The distribution is installed (its metadata is found), whether or not this process may import it."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
