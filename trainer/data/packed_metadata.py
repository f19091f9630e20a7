"""Packed-sequence metadata: sample boundaries built once per batch, reused by every layer.

Why: a packed row ``[1, T]`` holds several samples back to back, and attention must stay inside
each one. Stock transformers (and Unsloth before PR #4243) re-derive the boundaries in every
layer, and again in every gradient-checkpoint recompute, from the *device* position ids:
``nonzero`` / ``.item()`` / ``.tolist()`` each drain the GPU queue (a host sync), and the SDPA
path rebuilds an O(T^2) mask each time. The lengths are known on the host before the batch
moves, so everything can be built once, on the host, and copied without a sync.

For lengths ``[3, 2, 4]``::

    position_ids   0 1 2 0 1 0 1 2 3      (restart per sample; RoPE reads them)
    segment_ids    0 0 0 1 1 2 2 2 2      (which sample each token belongs to)
    cu_seqlens     [0, 3, 5, 9]           (int32, on the device: varlen kernels)
    max_seqlen     4                      (a Python int: sizes kernel grids, never ``.item()``)

and, built lazily and once per (structure, window, device), whatever the attention backend
needs: the ``(cu_seqlens, max_seqlen)`` pair for the varlen kernels, a document-causal boolean
mask ``[1, 1, T, T]`` for SDPA (O(T^2) memory: the CPU / last-resort path), or a flex-attention
``BlockMask``. Sliding-window layers (Mistral, GPT-OSS's alternate layers) get their own entry,
keyed by the window, so models that alternate windows never rebuild.

Shared prefixes (``prefixes``, GRPO's groups): a sample may name an earlier sample as its prefix;
it then sees every token of that prefix before its own (a prompt trained once for the ``G``
completions after it) and its positions continue from the prefix's length. The samples sharing a
prefix follow it, contiguous. For lengths ``[3, 2, 2]`` with prefixes ``[-1, 0, 0]``::

    position_ids   0 1 2 3 4 3 4
    prefix_rows    [[0, 0, 7], [0, 3, 5], [0, 3, 7]]   (prefix start, prefix length, query end)

The Triton and SDPA backends (and flex) take them, and ``torch_varlen`` through the Triton kernel
(``varlen_attn`` has no prefix; ``PREFIX_BACKENDS``); not the cache-off twin, which re-derives
boundaries from positions.

The surface (STYLE.md §4): ``build_packed_metadata(lengths, device, backend=..., cache=...)``
returns a ``PackedMetadata`` (cache on) or an ``UncachedPackedMetadata`` (cache off, the honest
"before": every ``layer_view`` call re-derives everything from the device position ids with
the syncs that implies). Both have the same interface; ``trainer.features.attention.packed`` calls
``meta.layer_view(position_ids)`` in every layer and asks the result for its structure. Both
count their builds in ``meta.counter`` so tests can prove "once per batch" vs "once per layer".

No host sync when the cache is on: host tensors are built from Python ints; on CUDA they are
pinned and copied with ``non_blocking=True`` (the pinned buffers stay referenced by this object
until it is dropped, so the copy never reads freed memory); masks are built on the device from
those copies with element-wise ops only. ``tests/gpu/test_packed_metadata_gpu.py`` checks it
under ``torch.cuda.set_sync_debug_mode("error")``.

Shapes (legend): ``T`` packed tokens, ``N`` samples. One packed row per batch (``[1, T]``),
as ``trainer.data.packing.PackedBatch`` produces.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BACKENDS = ("triton", "torch_varlen", "flex", "sdpa")
"""Attention backends a metadata object can serve; ``trainer.features.attention.packed`` implements them."""
PREFIX_BACKENDS = ("triton", "torch_varlen", "flex", "sdpa")
"""The backends that take shared prefixes (see the module docstring; ``torch_varlen`` runs a prefixed
batch on the Triton kernel, so it needs that kernel's head dims: ``PackedAttentionHandle.takes_prefixes``)."""


@dataclass
class BuildCounter:
    """How often metadata and per-backend structures were built (tests read it; costs nothing)."""

    metadata: int = 0
    """Boundary metadata builds (cu_seqlens, max_seqlen, positions): 1 per batch when cached."""
    structures: collections.Counter = field(default_factory=collections.Counter)
    """Builds per structure key, e.g. ``("dense_mask", None, "cpu")``."""

    @property
    def total_structures(self) -> int:
        return sum(self.structures.values())


@dataclass(frozen=True, eq=False)
class PackedMetadata:
    """Boundary metadata of one packed row on one device, with a lazy per-structure cache.

    Build with ``build_packed_metadata``; do not mutate its tensors (layers share them).
    """

    lengths: tuple[int, ...]
    """Sample lengths, host-side Python ints; they sum to ``total``."""
    total: int
    """T, the packed row's token count."""
    max_seqlen: int
    """Longest sample, a Python int."""
    device: torch.device
    """The device the batch (and the first copy of every tensor) lives on."""
    backend: str
    """Which attention backend the layers run (one of ``BACKENDS``)."""
    position_ids: torch.Tensor
    """[1, T] int64 on ``device``: positions restarting at 0 per sample (pass to the model)."""
    segment_ids: torch.Tensor
    """[T] int32 on ``device``: the sample index of each token."""
    cu_seqlens: torch.Tensor
    """[N + 1] int32 on ``device``: sample offsets, 0 .. T."""
    prefix_of: tuple[int, ...] | None = None
    """Per sample, the sample it continues (its shared prefix) or -1; None: no sample has one."""
    prefix_table: torch.Tensor | None = None
    """[N, 3] int32 on ``device`` (``prefix_rows``), with ``prefix_of``."""
    counter: BuildCounter = field(default_factory=BuildCounter, repr=False)
    _cache: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    _keepalive: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    """Pinned host buffers that non-blocking copies read from; held until this object dies."""

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def model_kwargs(self) -> dict[str, Any]:
        """What the model's forward needs next to ``input_ids``: positions and this object.

        transformers passes unknown keyword arguments through every decoder layer (and the
        checkpoint recompute) to the attention function, so ``packed_metadata`` reaches
        ``trainer.features.attention.packed`` in every layer. Do not pass ``attention_mask``.
        """
        return {"position_ids": self.position_ids, "packed_metadata": self}

    def layer_view(self, position_ids: torch.Tensor | None = None) -> PackedMetadata:
        """The metadata a layer uses: this object itself (cache on). ``position_ids`` is unused."""
        return self

    # -- per-backend structures, built once per (kind, window, device) ------------------------

    def prefix_rows(self, device: torch.device) -> torch.Tensor | None:
        """int32 [N, 3] ``(prefix start row, prefix length, query end row)`` per sample on ``device``
        (``prefix_rows``), or None without prefixes."""
        if self.prefix_table is None:
            return None
        return self._cached(("prefix_rows", None, device), lambda: _move(self.prefix_table, device))

    def varlen(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens on device, max_seqlen)`` for the varlen kernels (Triton, torch varlen)."""
        return self._cached(
            ("varlen", None, device),
            lambda: (_move(self.cu_seqlens, device), self.max_seqlen),
        )

    def dense_mask(self, window: int | None, device: torch.device) -> torch.Tensor:
        """Boolean ``[1, 1, T, T]`` mask, True where query i may attend key j (SDPA backend).

        j is in i's sample, ``j <= i``, and with a window ``i - j < window`` (transformers'
        ``sliding_window`` convention: a token sees ``window`` tokens, itself included); or j is
        in the shared prefix of i's sample.
        """
        return self._cached(
            ("dense_mask", window, device),
            lambda: self._build_dense_mask(window, device),
        )

    def additive_mask(
        self, window: int | None, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        """``dense_mask`` as an additive float mask (0 / -inf) in ``dtype`` (SDPA with sinks)."""
        key = ("additive_mask", window, device, dtype)
        return self._cached(
            key, lambda: _additive(self.dense_mask(window, device), dtype)
        )

    def block_mask(self, window: int | None, device: torch.device) -> Any:
        """Document-causal flex-attention ``BlockMask`` (with the window when given)."""
        return self._cached(
            ("block_mask", window, device),
            lambda: self._build_block_mask(window, device),
        )

    def _cached(self, key: tuple[Any, ...], build: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
            self.counter.structures[key] += 1
        return self._cache[key]

    def _build_dense_mask(
        self, window: int | None, device: torch.device
    ) -> torch.Tensor:
        seg_T = _move(self.segment_ids, device)
        pos_T = _move(self.position_ids[0], device)
        same_TT = seg_T[:, None] == seg_T[None, :]
        delta_TT = pos_T[:, None] - pos_T[None, :]  # i - j, meaningful inside a sample
        allowed_TT = same_TT & (delta_TT >= 0)
        if window is not None:
            allowed_TT &= delta_TT < window
        if self.prefix_of is not None:
            prefix_N = torch.tensor(self.prefix_of, dtype=torch.int32, device=device)
            allowed_TT |= prefix_N[seg_T.long()][:, None] == seg_T[None, :]
        return allowed_TT.view(1, 1, self.total, self.total)

    def _build_block_mask(self, window: int | None, device: torch.device) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        seg_T = _move(self.segment_ids, device)
        prefix_T = None
        if self.prefix_of is not None:
            prefix_T = torch.tensor(self.prefix_of, dtype=torch.int32, device=device)[seg_T.long()]

        def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            allowed = (seg_T[q_idx] == seg_T[kv_idx]) & (q_idx >= kv_idx)
            if window is not None:
                allowed = allowed & (q_idx - kv_idx < window)
            if prefix_T is not None:
                allowed = allowed | (prefix_T[q_idx] == seg_T[kv_idx])
            return allowed

        return create_block_mask(
            document_causal,
            B=None,
            H=None,
            Q_LEN=self.total,
            KV_LEN=self.total,
            device=device,
            _compile=device.type == "cuda",
        )


@dataclass(frozen=True, eq=False)
class UncachedPackedMetadata:
    """The cache-off twin: same interface, but every layer re-derives the metadata.

    ``layer_view(position_ids)`` rebuilds from the device position ids the way stock
    transformers' flash path and Unsloth before #4243 did: ``nonzero`` on the sample starts
    and ``.item()`` / ``.tolist()`` on the lengths (3 host syncs on CUDA), then the backend's
    structure from scratch. It runs in every layer and in every checkpoint recompute.
    """

    lengths: tuple[int, ...]
    total: int
    device: torch.device
    backend: str
    position_ids: torch.Tensor
    """[1, T] int64 on ``device``: the model's RoPE positions; the only thing layers rebuild from."""
    counter: BuildCounter = field(default_factory=BuildCounter, repr=False)
    _keepalive: tuple[torch.Tensor, ...] = field(default=(), repr=False)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def model_kwargs(self) -> dict[str, Any]:
        """Same as ``PackedMetadata.model_kwargs``."""
        return {"position_ids": self.position_ids, "packed_metadata": self}

    def layer_view(self, position_ids: torch.Tensor | None = None) -> PackedMetadata:
        """Re-derive the metadata from the layer's device ``position_ids`` (host syncs included)."""
        if position_ids is None:
            raise ValueError(
                "packed_metadata_cache=off rebuilds boundaries from position_ids in every layer, but the "
                "attention layer got none; pass **meta.model_kwargs() to the model"
            )
        pos_T = position_ids.reshape(-1)
        starts_T = pos_T == 0
        start_idx = torch.nonzero(
            starts_T
        ).flatten()  # host sync: output size depends on data
        end = torch.tensor([pos_T.numel()], device=pos_T.device, dtype=start_idx.dtype)
        cu_seqlens = torch.cat([start_idx, end]).to(torch.int32)
        lengths_N = cu_seqlens.diff()
        max_seqlen = int(lengths_N.max().item())  # host sync
        lengths = tuple(lengths_N.tolist())  # host sync
        segment_ids = (torch.cumsum(starts_T.to(torch.int32), 0) - 1).to(torch.int32)
        self.counter.metadata += 1
        return PackedMetadata(
            lengths=lengths,
            total=pos_T.numel(),
            max_seqlen=max_seqlen,
            device=pos_T.device,
            backend=self.backend,
            position_ids=pos_T.view(1, -1),
            segment_ids=segment_ids,
            cu_seqlens=cu_seqlens,
            counter=self.counter,
        )


AnyPackedMetadata = PackedMetadata | UncachedPackedMetadata


def build_packed_metadata(
    lengths: Sequence[int],
    device: torch.device | str,
    *,
    backend: str = "sdpa",
    cache: bool = True,
    prefixes: Sequence[int] | None = None,
) -> AnyPackedMetadata:
    """Build the metadata of one packed row from its host-side sample lengths.

    Call once per packed micro-batch, before the forward, with the ``lengths`` the packer
    produced (``trainer.data.packing.PackedBatch.lengths``).

    Args:
        lengths: sample lengths in packing order (Python ints, each >= 1).
        device: where the batch lives.
        backend: the attention backend the layers run (one of ``BACKENDS``).
        cache: True builds once and every layer reuses it; False returns the rebuild-per-layer twin.
        prefixes: per sample, the earlier sample it continues (its shared prefix) or -1; None: none
            (see the module docstring). Needs ``cache`` and a backend of ``PREFIX_BACKENDS``.

    Returns:
        ``PackedMetadata`` (cache on) or ``UncachedPackedMetadata`` (cache off).

    Raises:
        ValueError: empty or non-positive lengths, an unknown backend, or prefixes that are not
            earlier samples followed by the samples sharing them, or that this backend cannot take.
        TypeError: ``lengths`` is a tensor (it must be host-side Python ints).
    """
    lengths = _check_lengths(lengths)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    device = _resolve_device(device)
    total = sum(lengths)
    prefix_of = None if prefixes is None else _check_prefixes(prefixes, lengths, backend, cache)
    offsets = [0] * len(lengths) if prefix_of is None else [0 if p < 0 else lengths[p] for p in prefix_of]
    positions = torch.cat([torch.arange(o, o + n, dtype=torch.int64) for o, n in zip(offsets, lengths)]).view(
        1, total
    )
    if not cache:
        (pos_dev,), keep = _to_device([positions], device)
        return UncachedPackedMetadata(
            lengths, total, device, backend, pos_dev, _keepalive=keep
        )
    segments = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    host = [positions, segments, cu] + ([] if prefix_of is None else [prefix_rows(lengths, prefix_of)])
    (pos_dev, seg_dev, cu_dev, *table), keep = _to_device(host, device)
    return PackedMetadata(
        lengths=lengths, total=total, max_seqlen=max(lengths), device=device, backend=backend,
        position_ids=pos_dev, segment_ids=seg_dev, cu_seqlens=cu_dev, prefix_of=prefix_of,
        prefix_table=table[0] if table else None, counter=BuildCounter(metadata=1), _keepalive=keep,
    )


def prefix_rows(lengths: Sequence[int], prefix_of: Sequence[int]) -> torch.Tensor:
    """The kernels' int32 [N, 3] per sample: ``(prefix start row, prefix length, query end row)``.
    A sample without a prefix has ``(0, 0, ...)``; a sample others share as their prefix has the end
    row of the last of them as its query end (the rows whose queries see its keys), else its own end."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    rows = [[0, 0, starts[s + 1]] for s in range(len(lengths))]
    for s, p in enumerate(prefix_of):
        if p >= 0:
            rows[s][0], rows[s][1] = starts[p], lengths[p]
            rows[p][2] = max(rows[p][2], starts[s + 1])
    return torch.tensor(rows, dtype=torch.int32).view(len(lengths), 3)


def _check_prefixes(prefixes: Sequence[int], lengths: tuple[int, ...], backend: str, cache: bool) -> tuple[int, ...]:
    if not cache or backend not in PREFIX_BACKENDS:
        raise ValueError(f"shared prefixes need the metadata cache and one of {', '.join(PREFIX_BACKENDS)} "
                         f"attention; this batch runs {backend} with the cache {'on' if cache else 'off'}")
    out = tuple(int(p) for p in prefixes)
    if len(out) != len(lengths):
        raise ValueError(f"prefixes: one per sample ({len(lengths)}), got {len(out)}")
    for s, p in enumerate(out):
        if p < 0:
            continue
        if p >= s or out[p] >= 0:
            raise ValueError(f"prefixes[{s}] = {p}: a prefix is an earlier sample that has no prefix itself")
        if any(out[m] != p for m in range(p + 1, s)):
            raise ValueError(f"prefixes[{s}] = {p}: the samples sharing a prefix must follow it, contiguous")
    return out


def _resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` becomes the current one, to match the tensors' device in cache keys."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    if isinstance(lengths, torch.Tensor):
        raise TypeError(
            "lengths must be host-side Python ints (e.g. PackedBatch.lengths), not a tensor: reading a "
            "device tensor back costs a host sync, which is what this metadata exists to avoid"
        )
    out = tuple(int(n) for n in lengths)
    if not out:
        raise ValueError("lengths is empty: a packed batch needs at least one sample")
    bad = [n for n in out if n < 1]
    if bad:
        raise ValueError(
            f"every sample length must be >= 1, got {bad[:5]}; drop empty samples before packing"
        )
    return out


def _to_device(
    host: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Copy host tensors to ``device`` without a host sync (pinned + non_blocking on CUDA)."""
    if device.type != "cuda":
        return [t.to(device) for t in host], ()
    pinned = [t.pin_memory() for t in host]
    return [t.to(device, non_blocking=True) for t in pinned], tuple(pinned)


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Device-to-device copy for layers on another GPU (device_map splits); no host sync."""
    return t if t.device == device else t.to(device, non_blocking=True)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)
