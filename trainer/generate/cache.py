"""The sampler's KV cache: one contiguous ``[slots, Hkv, max_len, D]`` key and value tensor per layer.

Layout: slot-major and contiguous, allocated once per engine shape (``slots``, ``max_len``) and
reused by every step and every ``generate`` call of that shape: a sequence owns one slot from
its prefill to its finish, its token at position ``p`` lives at ``[slot, :, p]``, and a finished
sequence's slot is handed to the next one in the queue without clearing it (positions past the
new sequence's length are masked out).

Why not paged (vLLM's block tables): a contiguous slot is what plain torch indexing reads
exactly on CPU and what a decode kernel reads with one base pointer per slot; its cost is that
every slot reserves ``max_len`` positions however short its sequence, so a mix of short and long
sequences fits fewer at once than pages would, and ``n`` choices of one prompt copy the prompt's
keys instead of sharing pages. Those are the reasons to page later (with the GPU decode kernel);
the scheduler only hands out slot numbers, so a block table can replace them without touching it.
Sliding-window layers keep all ``max_len`` positions too (a ring buffer of the window is another
later saving).

Shapes (legend): ``S`` slots, ``Hkv`` key/value heads, ``L`` max_len, ``D`` head dim, ``T`` tokens
of a step.
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    """Per-layer keys and values of ``slots`` sequences of up to ``max_len`` tokens.

    Args:
        layers: decoder layers (one K and one V tensor each).
        slots: sequences held at once.
        kv_heads, head_dim: the attention's key/value heads and head size.
        max_len: positions per slot (prompt + generated tokens).
        dtype, device: of the stored keys and values (the dtype the attention projections produce).
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        # Zeroed once: a masked position's probability (0) still multiplies what the slot holds
        # there, which must be finite (stale keys of an earlier sequence are; uninitialised memory
        # may be NaN).
        self.keys_SHLD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values_SHLD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.max_len = slots, max_len

    @classmethod
    def for_model(cls, config: Any, slots: int, max_len: int, dtype: torch.dtype,
                  device: torch.device | str) -> KVCache:
        """A cache shaped for a transformers ``config`` (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, slots, kv_heads, max_len, head_dim, dtype, device)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keys_SHLD[0].shape)

    @property
    def nbytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.keys_SHLD)

    def write(self, layer: int, slot_T: torch.Tensor, pos_T: torch.Tensor, key_THD: torch.Tensor,
              value_THD: torch.Tensor) -> None:
        """Store each token's key and value at its slot and position (cast to the cache's dtype)."""
        keys, values = self.keys_SHLD[layer], self.values_SHLD[layer]
        if key_THD.shape[1:] != (keys.shape[1], keys.shape[3]):
            raise ValueError(
                f"layer {layer}: keys of shape {tuple(key_THD.shape)} do not fit a cache of "
                f"[slots, {keys.shape[1]} kv heads, {keys.shape[2]}, {keys.shape[3]} head dim]"
            )
        # Advanced indices around a slice put the indexed dimension first: [T, Hkv, D].
        keys[slot_T, :, pos_T] = key_THD.to(keys.dtype)
        values[slot_T, :, pos_T] = value_THD.to(values.dtype)

    def copy_prefix(self, source: int, targets: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slot ``source`` into each of ``targets`` (the
        prompt of ``n`` choices prefilled once)."""
        if not targets:
            return
        index = torch.tensor(targets, device=self.keys_SHLD[0].device)
        for tensor in (*self.keys_SHLD, *self.values_SHLD):
            rows = tensor[source, :, :length].unsqueeze(0).expand(len(targets), -1, -1, -1)
            tensor[:, :, :length].index_copy_(0, index, rows)
