"""Helpers shared by the GPU tests (imported by name: the tests put this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Every synchronizing CUDA call inside raises (``torch.cuda.set_sync_debug_mode("error")``)."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
