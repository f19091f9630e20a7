"""The device part of offloaded checkpointing, injected into ``ActivationOffloader``.

``CudaStreams``: streams, events, pinned host memory and buffer allocation of one CUDA device.
``SyncStreams``: the CPU twin: copies run at once, events and waits are no-ops, so CI runs the
very code path the GPU runs. Stream safety (who waits on what): ``trainer.features.offload.offloader``.
"""

from __future__ import annotations

from typing import Any

import torch


class SyncStreams:
    """The CPU twin of ``CudaStreams``: one implicit stream, copies done at once, events no-ops.

    Everything that is ordered by events on a GPU is ordered by program order here, so the
    offloader's code path runs unchanged and must give the same numbers.
    """

    def main(self) -> None:
        return None

    def side(self) -> None:
        return None

    def event(self) -> None:
        return None

    def record(self, event: Any, stream: Any) -> None:
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        dst.copy_(src)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def host_empty(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def device_empty(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)


class CudaStreams:
    """Streams, events and pinned memory of one CUDA device; one side stream for D2H and H2D.

    One side stream carries both directions, so a pinned host copy is always written (forward)
    before it is read (backward) by stream order alone. Created lazily by the offloader (no CUDA
    context at import).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device=device)

    def main(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def side(self) -> torch.cuda.Stream:
        return self._side

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream
    ) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # The allocator will not hand this memory out again until the work queued on `stream`
        # at the time the tensor is freed (the D2H copy) has finished.
        tensor.record_stream(stream)

    def host_empty(self, like: torch.Tensor) -> torch.Tensor:
        # torch's caching host allocator recycles pinned blocks, and records an event on the copy's
        # stream, so a block is not reused while a copy from it is still queued.
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)

    def device_empty(
        self, numel: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        buffer.record_stream(
            self._side
        )  # written on the side stream: freeing waits for its copies
        return buffer


def streams_for(device: torch.device) -> SyncStreams | CudaStreams:
    return CudaStreams(device) if device.type == "cuda" else SyncStreams()
