"""Host lists to device tensors without making the host wait for the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``; on CUDA through pinned memory without blocking.

    Why: a copy from pageable host memory first waits for every kernel already queued on the
    stream, so a step that builds its inputs while the previous forward runs would wait for that
    forward (``trainer.generate.overlap``). A pinned buffer is reused only after its copy is done
    (torch's caching host allocator records the copy on the stream)."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)
