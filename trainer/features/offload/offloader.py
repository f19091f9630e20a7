"""Offloaded activation checkpointing per decoder layer, with an event-ordered double-buffered reload.

Overview and the reason for two buffers: ``trainer.features.offload`` (the package docstring).

The algorithm, per pass (one micro-batch's forward and its backward), ``L`` wrapped layers::

    forward, layer i < L-1:  main records ``input_ready``; side waits on it; side copies the input
                             D2H into its own pinned host tensor; the GPU input is released to the
                             allocator only after that copy (``record_stream``); the layer runs
                             under no_grad on main (the D2H overlaps it).
    forward, layer L-1:      input kept on the GPU: backward needs it first, nothing to overlap.
    backward, layer i:       [load i now if it was not prefetched]; main waits ``copy_done[slot(i)]``;
                             PREFETCH: side waits ``released[slot(i-1)]`` (recorded after the
                             backward of the layer that last read that buffer, i.e. i+1) -- or
                             the whole main stream when the buffer was just (re)allocated -- and
                             copies layer i-1's input H2D into buffer ``slot(i-1)``, records
                             ``copy_done[slot(i-1)]``; main recomputes layer i from buffer
                             ``slot(i)`` with grad and runs its backward; main records
                             ``released[slot(i)]``.
    slot(i) = i % 2 (double buffer), 0 (single buffer)

Stream safety (every tensor one stream makes and another uses): the forward's input is read by
the side stream's D2H after ``input_ready`` and freed with ``record_stream(side)``; pinned host
blocks are recycled by torch's host allocator only after the copies that used them (it records
an event on the copy's stream); a buffer written by side is read by main only after
``copy_done``, and overwritten by side only after ``released`` (recorded on main after the whole
recompute AND backward of its reader, which both run inside that layer's ``Function.backward``,
so no autograd-saved view of the buffer outlives it); a buffer is allocated from main's pool and
its first copy waits for all of main (the bug the H200 showed before this wait existed: the
first prefetch wrote into a block whose previous tensor's kernels were still queued on main,
giving 1e11-sized or NaN LoRA gradients at 8B/14B scale while every small test passed).

The prefetch is explicit (issued by layer i's backward for layer i-1, one layer ahead), not an
accident of queueing. With ``double_buffer=False`` (the switch's ``off``) the same offload
reloads synchronously into one buffer: side waits for the WHOLE main stream, copies, main waits.
No offload at all is ordinary gradient checkpointing (``trainer.model.load``), and ``NoOffload`` is
the twin with this module's surface that does nothing.

Only the hidden-state input (first positional argument, or ``hidden_states=``) is offloaded;
other arguments (position embeddings, masks, packed metadata, position ids) are the same
objects for every layer and are kept as they are. The recompute replays the CPU and device RNG
state (dropout masks are the forward's) and the autocast state, as ``torch.utils.checkpoint``
does. A pass starts whenever a layer at or below the previous one runs forward, so gradient
accumulation (forward, backward, forward, backward) and even several forwards before one
backward are handled: each call owns its pinned host copy, and a reload that finds its buffer
taken by another pass's pending prefetch simply reloads again.

Shapes (legend): ``T`` packed tokens, ``H`` hidden size; layer inputs are ``[1, T, H]``; the two
GPU buffers are flat ``[N]`` tensors of the hidden dtype, grown (never shrunk) to the largest
``T x H`` seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.features.offload.schedule import Entry, Load, Pass, ReloadSchedule, Step
from trainer.features.offload.streams import CudaStreams, SyncStreams, streams_for


_UNSET = object()  # a layer without an instance-level gradient_checkpointing before apply


@dataclass
class _Call:
    """Everything one layer call's backward needs, beyond the tensors autograd hands it."""

    offloader: ActivationOffloader
    layer: int
    forward: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pass_: Pass | None = None
    entry: Entry | None = None
    shape: torch.Size | None = None
    rng_cpu: torch.Tensor | None = None
    rng_device: torch.Tensor | None = None
    autocast: tuple[str, bool, torch.dtype] | None = None
    output_layout: tuple[bool, ...] | None = None
    """Per element of a tuple output, whether it is a tensor (an output of the Function); None: one tensor."""
    raw_outputs: tuple[Any, ...] = ()


class _OffloadedLayer(torch.autograd.Function):
    """One checkpointed layer call whose saved input lives in pinned host memory."""

    @staticmethod
    def forward(
        ctx: Any, call: _Call, anchor: torch.Tensor, hidden: torch.Tensor
    ) -> Any:
        ctx.call = call
        kept = call.offloader._save_input(call, hidden)
        if kept is not None:
            ctx.save_for_backward(kept)
        out = call.forward(hidden, *call.args, **call.kwargs)
        if isinstance(out, torch.Tensor):
            call.output_layout = None
            return out
        if not isinstance(out, tuple):
            raise TypeError(
                f"decoder layer returned {type(out).__name__}; offloading supports a tensor or a tuple output"
            )
        call.output_layout = tuple(isinstance(o, torch.Tensor) for o in out)
        call.raw_outputs = tuple(
            None if isinstance(o, torch.Tensor) else o for o in out
        )
        tensors = tuple(o for o in out if isinstance(o, torch.Tensor))
        non_diff = [t for t in tensors if not t.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tensors

    @staticmethod
    def backward(
        ctx: Any, *grads: torch.Tensor | None
    ) -> tuple[None, None, torch.Tensor | None]:
        call: _Call | None = ctx.call
        if call is None:
            raise RuntimeError(
                "an offloaded layer ran backward twice; offloaded checkpointing supports one backward per "
                "forward (no retain_graph=True); turn offload_activations off for this use"
            )
        saved = ctx.saved_tensors
        x = call.offloader._restore_input(call, saved[0] if saved else None)
        x = x.detach().requires_grad_(True)
        with _replay_state(call), torch.enable_grad():
            out = call.forward(x, *call.args, **call.kwargs)
        outs = (
            (out,)
            if isinstance(out, torch.Tensor)
            else tuple(o for o in out if isinstance(o, torch.Tensor))
        )
        pairs = [
            (o, g)
            for o, g in zip(outs, grads, strict=True)
            if g is not None and o.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        call.offloader._release_input(call)
        ctx.call = None  # drop args/kwargs references early
        return None, None, (x.grad if ctx.needs_input_grad[2] else None)


@contextlib.contextmanager
def _replay_state(call: _Call) -> Iterator[None]:
    """Run the recompute with the forward's RNG and autocast state (as torch.utils.checkpoint does)."""
    device_type, autocast_on, autocast_dtype = call.autocast
    devices = [call.offloader.device] if call.rng_device is not None else []
    with contextlib.ExitStack() as stack:
        if call.rng_cpu is not None:
            stack.enter_context(
                torch.random.fork_rng(
                    devices=devices, device_type=device_type or "cuda"
                )
            )
            torch.set_rng_state(call.rng_cpu)
            if call.rng_device is not None:
                torch.cuda.set_rng_state(call.rng_device, call.offloader.device)
        stack.enter_context(
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on)
        )
        yield


class ActivationOffloader:
    """Offloaded activation checkpointing for a model's decoder layers.

    Args:
        device: the training device (a CUDA device on a GPU; CPU runs the same code path
            synchronously through ``SyncStreams``).
        double_buffer: reload into two alternating buffers with a one-layer prefetch (``on``),
            or synchronously into one buffer (``off``).
        streams: the device part; default ``CudaStreams`` on CUDA, ``SyncStreams`` elsewhere.
        min_offload_bytes: layer inputs smaller than this stay on the GPU.
        preserve_rng_state: replay the forward's RNG in the recompute (needed for dropout).
    """

    enabled = True

    def __init__(
        self,
        device: torch.device | str,
        *,
        double_buffer: bool = True,
        streams: SyncStreams | CudaStreams | None = None,
        min_offload_bytes: int = 0,
        preserve_rng_state: bool = True,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.double_buffer = double_buffer
        self.min_offload_bytes = min_offload_bytes
        self.preserve_rng_state = preserve_rng_state
        self._streams = streams
        self.schedule: ReloadSchedule | None = None
        self._buffers: list[torch.Tensor | None] = []
        self._copy_done: list[Any] = []
        self._released: list[Any] = []
        self._input_ready: Any = None
        self._layers: list[torch.nn.Module] = []
        self._hf_flags: list[object] = []

    # -- public surface ---------------------------------------------------------------------

    def apply(
        self, model: torch.nn.Module, layers: list[torch.nn.Module] | None = None
    ) -> torch.nn.Module:
        """Wrap the decoder layers of ``model`` (found by ``decoder_layers`` unless given); returns ``model``.

        Raises:
            ValueError: already applied, or no unique decoder-layer list was found.
        """
        if self._layers:
            raise ValueError(
                "this offloader is already applied to a model; call remove() first"
            )
        layers = list(layers) if layers is not None else decoder_layers(model)
        for layer in layers:
            if "forward" in vars(layer):
                raise ValueError(
                    f"{type(layer).__name__} already has an instance-level forward (another wrapper, or "
                    "offloading applied twice); remove it first"
                )
        self.schedule = ReloadSchedule(len(layers), double_buffer=self.double_buffer)
        if self._streams is None:
            self._streams = streams_for(self.device)
        s = self._streams
        self._buffers = [None] * self.schedule.num_slots
        self._copy_done = [s.event() for _ in range(self.schedule.num_slots)]
        self._released = [s.event() for _ in range(self.schedule.num_slots)]
        self._input_ready = s.event()
        # transformers 5.17 checkpoints in the layer's __call__ when its flag is set (a second recompute
        # around ours); later releases in a forward wrapper that _unwrapped_forward skips.
        self._hf_flags = [vars(layer).get("gradient_checkpointing", _UNSET) for layer in layers]
        for index, layer in enumerate(layers):
            layer.forward = self._wrap(layer, index)
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False
        self._layers = layers
        return model

    def remove(self, model: torch.nn.Module | None = None) -> None:
        """Undo ``apply`` and free the GPU buffers."""
        for layer, flag in zip(self._layers, self._hf_flags):
            vars(layer).pop("forward", None)
            if flag is _UNSET:
                vars(layer).pop("gradient_checkpointing", None)
            else:
                layer.gradient_checkpointing = flag
        self._layers, self._hf_flags = [], []
        self.release_buffers()

    def release_buffers(self) -> None:
        """Free the GPU reload buffers (they are reallocated on the next backward)."""
        self._buffers = [None] * len(self._buffers)
        if self.schedule is not None:
            self.schedule.capacity = [0] * self.schedule.num_slots
            self.schedule.owner = [None] * self.schedule.num_slots

    @property
    def buffer_bytes(self) -> list[int]:
        """Bytes of each GPU reload buffer allocated so far."""
        return [0 if b is None else b.numel() * b.element_size() for b in self._buffers]

    @property
    def extra_gpu_bytes(self) -> int:
        """GPU memory of the second buffer: what double buffering costs over single buffering."""
        sizes = self.buffer_bytes
        return sizes[1] if len(sizes) > 1 else 0

    @property
    def trace(self) -> list[Step]:
        return [] if self.schedule is None else self.schedule.trace

    @property
    def num_layers(self) -> int:
        """Decoder layers wrapped by ``apply`` (0 before)."""
        return len(self._layers)

    # -- the wrapper --------------------------------------------------------------------------

    def _wrap(self, layer: torch.nn.Module, index: int) -> Callable[..., Any]:
        inner = _unwrapped_forward(layer)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (torch.is_grad_enabled() and layer.training):
                return inner(*args, **kwargs)
            if args:
                hidden, rest = args[0], args[1:]
            elif "hidden_states" in kwargs:
                kwargs = dict(kwargs)
                hidden, rest = kwargs.pop("hidden_states"), ()
            else:
                raise TypeError(
                    f"{type(layer).__name__} called without a hidden-state argument"
                )
            _check_passthrough(type(layer).__name__, rest, kwargs)
            call = _Call(
                offloader=self, layer=index, forward=inner, args=rest, kwargs=kwargs
            )
            anchor = _anchor(hidden)
            out = _OffloadedLayer.apply(call, anchor, hidden)
            if call.output_layout is None:
                return out
            tensors = iter(out if isinstance(out, tuple) else (out,))
            return tuple(
                next(tensors) if is_tensor else raw
                for is_tensor, raw in zip(
                    call.output_layout, call.raw_outputs, strict=True
                )
            )

        return forward

    # -- called from _OffloadedLayer -------------------------------------------------------------

    def _save_input(self, call: _Call, hidden: torch.Tensor) -> torch.Tensor | None:
        """Start the D2H copy of ``hidden`` (or keep it); capture RNG/autocast. Returns the tensor to save."""
        s = self._streams
        schedule = self.schedule
        small = hidden.numel() * hidden.element_size() < self.min_offload_bytes
        call.pass_, call.entry = schedule.forward(
            call.layer, hidden.numel(), small=small
        )
        call.shape = hidden.shape
        device_type = hidden.device.type
        call.autocast = (
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )
        if self.preserve_rng_state:
            call.rng_cpu = torch.get_rng_state()
            if device_type == "cuda":
                call.rng_device = torch.cuda.get_rng_state(self.device)
        if not call.entry.offloaded:
            return hidden
        main, side = s.main(), s.side()
        host = s.host_empty(hidden)
        s.record(self._input_ready, main)
        s.wait_event(side, self._input_ready)
        s.copy(host, hidden, side)
        s.keep_alive(hidden, side)
        call.entry.host = host
        return None

    def _restore_input(self, call: _Call, kept: torch.Tensor | None) -> torch.Tensor:
        """Issue the planned copies and return the layer's input (a view of its buffer, or the kept tensor)."""
        s = self._streams
        plan = self.schedule.backward(call.pass_, call.entry)
        for load in plan.loads:
            self._issue(load)
        if plan.read_slot is None:
            return kept
        s.wait_event(s.main(), self._copy_done[plan.read_slot])
        return self._buffers[plan.read_slot][: call.entry.numel].view(call.shape)

    def _issue(self, load: Load) -> None:
        s = self._streams
        main, side = s.main(), s.side()
        host: torch.Tensor = load.entry.host
        buffer = self._buffers[load.slot]
        allocated = False
        if load.grow_to is not None or buffer is None or buffer.dtype != host.dtype:
            size = max(
                load.grow_to or 0,
                load.entry.numel,
                0 if buffer is None else buffer.numel(),
            )
            buffer = self._buffers[load.slot] = s.device_empty(
                size, host.dtype, self.device
            )
            allocated = True
        if load.wait == "main" or allocated:
            # also for a buffer re-made for another dtype: fresh memory from main's pool (see _load)
            s.wait_stream(side, main)
        elif load.wait is not None:
            s.wait_event(side, self._released[load.slot])
        s.copy(buffer[: load.entry.numel].view(host.shape), host, side)
        s.record(self._copy_done[load.slot], side)

    def _release_input(self, call: _Call) -> None:
        entry = call.entry
        self.schedule.done(entry)
        if entry.offloaded:
            self._streams.record(self._released[entry.slot], self._streams.main())
            entry.host = None  # the pinned block returns to torch's host cache once its copies finish


class NoOffload:
    """The no-op twin of ``ActivationOffloader``: same surface, the model is left as it is."""

    enabled = False
    double_buffer = False

    def apply(
        self, model: torch.nn.Module, layers: list[torch.nn.Module] | None = None
    ) -> torch.nn.Module:
        return model

    def remove(self, model: torch.nn.Module | None = None) -> None:
        pass

    def release_buffers(self) -> None:
        pass

    @property
    def buffer_bytes(self) -> list[int]:
        return []

    @property
    def extra_gpu_bytes(self) -> int:
        return 0

    @property
    def trace(self) -> list[Step]:
        return []

    @property
    def num_layers(self) -> int:
        return 0


def build(
    device: torch.device | str, *, offload: bool, double_buffer: bool
) -> ActivationOffloader | NoOffload:
    """The offloader the plan asked for, or its no-op twin when offload is off."""
    if not offload:
        return NoOffload()
    return ActivationOffloader(device, double_buffer=double_buffer)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder-layer list of an HF causal LM (also inside peft): the one ``ModuleList`` named
    ``layers`` whose items are ``GradientCheckpointingLayer``s.

    Raises:
        ValueError: none or several such lists; pass ``layers=`` to ``apply`` instead.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and name.split(".")[-1] == "layers"
        and len(module) > 0
        and all(isinstance(m, GradientCheckpointingLayer) for m in module)
    ]
    if len(found) != 1:
        names = ", ".join(n for n, _ in found) or "none"
        raise ValueError(
            f"{type(model).__name__}: expected one decoder-layer list, found {names}; pass layers= to apply()"
        )
    return list(found[0][1])


def _unwrapped_forward(layer: torch.nn.Module) -> Callable[..., Any]:
    """``layer``'s forward without transformers' checkpointing wrapper (we checkpoint instead)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    forward = type(layer).forward
    if isinstance(layer, GradientCheckpointingLayer):
        forward = getattr(forward, "__wrapped__", forward)
    return forward.__get__(layer, type(layer))


def _anchor(hidden: torch.Tensor) -> torch.Tensor:
    """An empty tensor that requires grad, so the layer's output requires grad (and its backward
    runs, training the layer's adapters) even when the input does not: the embeddings of a LoRA
    model are frozen, so the first layer's input never requires grad."""
    return torch.empty(0, device=hidden.device, dtype=hidden.dtype, requires_grad=True)


def _check_passthrough(
    layer_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse arguments the reentrant recompute would get wrong (a gradient it cannot return, a cache)."""
    for name in ("past_key_values", "layer_past"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{layer_name}: {name} must be None when training with offloaded checkpoints"
            )
    values = list(args) + list(kwargs.values())
    while values:
        value = values.pop()
        if isinstance(value, (tuple, list)):
            values.extend(value)
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(
                f"{layer_name}: only the hidden state may require grad with offloaded checkpoints; another "
                f"argument of shape {tuple(value.shape)} does (compute it under torch.no_grad or detach it)"
            )
