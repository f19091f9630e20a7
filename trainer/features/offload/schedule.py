"""The reload schedule of offloaded checkpointing: plain Python bookkeeping, no torch.

``ReloadSchedule`` decides which layer inputs are offloaded, which GPU buffer each reload goes
into, which event each copy waits on, the prefetch order and buffer growth, and writes every
decision to ``trace`` as ``Step`` tuples. ``trainer.features.offload.offloader`` executes it on streams;
the algorithm is drawn in that module's docstring. Standard library only (a unit test holds it
to that), so the schedule is tested by hand without a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Step(NamedTuple):
    """One decision of the schedule, appended to ``ReloadSchedule.trace`` in order.

    ``op`` is one of:
      - ``offload``: forward of ``layer``; its input is copied D2H on the side stream.
      - ``keep``: forward of ``layer``; its input stays on the GPU (the last layer, or too small).
      - ``grow``: buffer ``slot`` is (re)allocated to ``after`` elements before a copy into it.
      - ``h2d``: copy of ``layer``'s input into buffer ``slot``; the side stream first waits on
        ``after``: an int = ``released[slot]`` recorded after that layer's backward, ``"main"`` =
        the whole main stream (single buffer, or a buffer just (re)allocated: its memory comes
        from the main stream's pool and may still be in use by main's queued kernels), None = the
        buffer was allocated earlier and never read since (no wait).
      - ``wait``: the main stream waits on ``copy_done[slot]`` before recomputing ``layer``.
      - ``backward``: ``layer`` recomputes and back-propagates reading buffer ``slot`` (None: the
        kept GPU input).
      - ``release``: main records ``released[slot]`` after ``layer``'s backward.
    """

    op: str
    layer: int
    slot: int | None = None
    after: int | str | None = None


@dataclass(eq=False)
class Entry:
    """One layer input of one pass. The executor stashes its own objects in ``host``."""

    layer: int
    numel: int
    offloaded: bool
    slot: int | None = None
    """Buffer the reload goes (or went) into."""
    loaded: bool = False
    """A copy into ``slot`` was issued and not overwritten since."""
    done: bool = False
    """Its backward has run."""
    host: Any = None


@dataclass(eq=False)
class Pass:
    """The entries of one forward pass (one micro-batch), by layer index."""

    entries: dict[int, Entry] = field(default_factory=dict)
    last_layer: int = -1


@dataclass(frozen=True)
class Load:
    """A copy to issue: ``entry``'s input into buffer ``slot``; ``wait`` as in ``Step.after``."""

    entry: Entry
    slot: int
    wait: int | str | None
    grow_to: int | None
    """New buffer size in elements when the buffer must grow first, else None."""


@dataclass(frozen=True)
class BackwardPlan:
    loads: tuple[Load, ...]
    """Copies to issue, in order: the layer's own (only when it was not prefetched), then the prefetch."""
    read_slot: int | None
    """Buffer the recompute reads (the main stream waits on its ``copy_done``); None: kept on GPU."""


class ReloadSchedule:
    """Which input is offloaded, which buffer each reload uses, what each copy waits on.

    Args:
        num_layers: wrapped decoder layers; the input of layer ``num_layers - 1`` stays on the GPU.
        double_buffer: two buffers with a one-layer prefetch (True) or one synchronous buffer.
    """

    def __init__(self, num_layers: int, *, double_buffer: bool) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.double_buffer = double_buffer
        self.num_slots = 2 if double_buffer else 1
        self.capacity = [0] * self.num_slots
        """Elements allocated per buffer (0: not allocated yet)."""
        self.owner: list[Entry | None] = [None] * self.num_slots
        self.released_by: list[int | None] = [None] * self.num_slots
        """Layer whose backward last read each buffer (its ``released`` event is the one to wait on)."""
        self.trace: list[Step] = []
        self._pass: Pass | None = None

    def slot_of(self, layer: int) -> int:
        return layer % self.num_slots

    def forward(
        self, layer: int, numel: int, *, small: bool = False
    ) -> tuple[Pass, Entry]:
        """Record ``layer``'s forward; a layer at or below the previous one starts a new pass.

        ``small``: the input is below the offloader's size threshold and stays on the GPU.
        """
        if self._pass is None or layer <= self._pass.last_layer:
            self._pass = Pass()
        p = self._pass
        p.last_layer = layer
        offloaded = layer != self.num_layers - 1 and not small
        entry = Entry(layer=layer, numel=numel, offloaded=offloaded)
        p.entries[layer] = entry
        self.trace.append(Step("offload" if offloaded else "keep", layer))
        return p, entry

    def backward(self, p: Pass, entry: Entry) -> BackwardPlan:
        """Plan ``entry``'s backward: its own reload if it was not prefetched, then the prefetch."""
        loads: list[Load] = []
        read_slot = None
        if entry.offloaded:
            if not (entry.loaded and self.owner[entry.slot] is entry):
                loads.append(self._load(entry))
            read_slot = entry.slot
            self.trace.append(Step("wait", entry.layer, read_slot))
        if self.double_buffer:
            previous = p.entries.get(entry.layer - 1)
            if (
                previous is not None
                and previous.offloaded
                and not previous.done
                and not (previous.loaded and self.owner[previous.slot] is previous)
            ):
                loads.append(self._load(previous))
        self.trace.append(Step("backward", entry.layer, read_slot))
        return BackwardPlan(loads=tuple(loads), read_slot=read_slot)

    def done(self, entry: Entry) -> None:
        """``entry``'s backward is enqueued: its buffer is free once ``released[slot]`` fires."""
        entry.done = True
        if entry.offloaded:
            slot = entry.slot
            self.released_by[slot] = entry.layer
            if self.owner[slot] is entry:
                self.owner[slot] = None
            self.trace.append(Step("release", entry.layer, slot))

    def _load(self, entry: Entry) -> Load:
        slot = self.slot_of(entry.layer)
        victim = self.owner[slot]
        if victim is not None and victim is not entry:
            victim.loaded = (
                False  # another pass's pending prefetch: it will reload on demand
            )
        grow_to = None
        if entry.numel > self.capacity[slot]:
            grow_to = self.capacity[slot] = entry.numel
            self.trace.append(Step("grow", entry.layer, slot, grow_to))
        # A (re)allocated buffer comes from the MAIN stream's pool: the caching allocator may hand
        # out a block whose previous tensor main freed while kernels reading or writing it are
        # still queued. The side-stream copy into it must wait for the whole main stream, or it
        # lands first and main's pending kernels overwrite it (or read its new bytes): the
        # garbage/NaN gradients seen on the H200 at 8B/14B scale.
        wait: int | str | None
        if grow_to is not None or not self.double_buffer:
            wait = "main"
        else:
            wait = self.released_by[slot]
        self.owner[slot] = entry
        entry.slot, entry.loaded = slot, True
        self.trace.append(Step("h2d", entry.layer, slot, wait))
        return Load(entry=entry, slot=slot, wait=wait, grow_to=grow_to)
