"""Offloaded activation checkpointing per decoder layer, with an event-ordered double-buffered reload.

Why: plain gradient checkpointing keeps every decoder layer's input on the GPU for the whole
forward (``layers x tokens x hidden`` elements: 4 GiB for an 8B model at 16k tokens in bf16).
Offloading moves those inputs to pinned host memory during forward and copies each one back
just before its layer is recomputed in backward. Reloading into ONE staging buffer (Unsloth
before unsloth-zoo PR #534) serialises ``bwd(i+1) -> copy(i) -> bwd(i)``: every copy sits on the
critical path. With TWO buffers, layer ``i-1``'s input is copied into the other buffer while
layer ``i`` recomputes and back-propagates, so a step costs ``L x max(copy, compute)`` instead
of ``L x (copy + compute)`` (seed figures on B200: +8.4% on 8B for 0.37 GB extra, +6.7% on 14B).

Pieces (all state on objects, nothing at import):

- ``schedule.ReloadSchedule``: plain Python, standard library only. Decides which layer inputs
  are offloaded, which buffer each reload goes into, which event each copy waits on, the
  prefetch order, and buffer growth; it writes every decision to ``trace`` (tests read it; it
  costs a tuple per layer).
- ``streams.SyncStreams`` / ``streams.CudaStreams``: the injected device part (streams, events,
  pinned host memory, buffer allocation). ``SyncStreams`` is the CPU twin: copies run at once,
  events and waits are no-ops, so CI runs the very code path the GPU runs.
- ``offloader.ActivationOffloader``: ``apply(model)`` wraps every decoder layer's ``forward`` (an
  instance attribute, so module names and state-dict keys do not change) in ``_OffloadedLayer``,
  a custom ``autograd.Function`` per layer call that recomputes in backward (reentrant style:
  the recompute's parameter gradients are accumulated by ``torch.autograd.backward`` inside it,
  so train with ``loss.backward()``, not ``torch.autograd.grad``). The algorithm and its stream
  safety are drawn in that module's docstring. ``NoOffload`` is the no-op twin, ``build`` picks.
- ``estimate``: the plan's numbers: ``estimate`` (layer-input bytes), the host and GPU headroom
  constants, ``double_buffer_supported``, ``host_available_bytes``.
"""

from trainer.features.offload.estimate import (
    ACTIVATION_SHARE,
    DOUBLE_BUFFER_HEADROOM_BYTES,
    HOST_HEADROOM_BYTES,
    WSL_PINNED_LIMIT_BYTES,
    ActivationEstimate,
    double_buffer_supported,
    estimate,
    host_available_bytes,
    is_wsl,
)
from trainer.features.offload.offloader import ActivationOffloader, NoOffload, build, decoder_layers
from trainer.features.offload.schedule import BackwardPlan, Entry, Load, Pass, ReloadSchedule, Step
from trainer.features.offload.streams import CudaStreams, SyncStreams, streams_for

__all__ = [
    "ACTIVATION_SHARE",
    "DOUBLE_BUFFER_HEADROOM_BYTES",
    "HOST_HEADROOM_BYTES",
    "WSL_PINNED_LIMIT_BYTES",
    "ActivationEstimate",
    "ActivationOffloader",
    "BackwardPlan",
    "CudaStreams",
    "Entry",
    "Load",
    "NoOffload",
    "Pass",
    "ReloadSchedule",
    "Step",
    "SyncStreams",
    "build",
    "decoder_layers",
    "double_buffer_supported",
    "estimate",
    "host_available_bytes",
    "is_wsl",
    "streams_for",
]
