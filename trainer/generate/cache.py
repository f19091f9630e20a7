"""The sampler's KV cache: per layer, contiguous ``[slots, Hkv, L, D]`` keys and values, and
optionally a prompt store ``[prompt slots, Hkv, Lp, D]`` that the ``n`` choices of a prompt share.

Layout: slot-major and contiguous, allocated once per engine shape and reused by every step and
every ``generate`` call of that shape: a sequence owns one slot from its prefill to its finish,
and a finished sequence's slot is handed to the next one in the queue without clearing it
(positions past the new sequence's length are masked out, or never read).

Two layouts, chosen per engine (``SharedPrompts``):

- **unshared** (no ``SharedPrompts``, the default): a sequence's token at position ``p`` lives
  at ``[slot, :, p]`` of its own slot, prompt included, so every slot reserves ``max_len``
  positions and the ``n`` choices of a prompt each get a copy of the prompt's keys
  (``copy_prefix``, after the one prefill).
- **shared prompts**: a sequence is (own slot, prompt slot, prompt length ``Lp_s``). Positions
  ``p < Lp_s`` are read from (and a prefill writes them to) ``[prompt slot, :, p]`` of the prompt
  store; positions ``p >= Lp_s`` (the generated tokens) live at ``[own slot, :, p - Lp_s]``. Each
  prompt is prefilled once into a prompt slot and every choice admitted with it references that
  slot; nothing is copied. An own slot then needs only the generated tokens' positions
  (``SharedPrompts.new_len``), the prompt store ``SharedPrompts.prompt_len`` per prompt, so GRPO's
  8 choices of a 256-token prompt with 512 new tokens take 512 positions each plus 256 for the
  group (``trainer.objectives.grpo`` reserves two prompt slots a group: 576 a sequence) instead of
  768. Every prompt goes to the prompt store in this layout (``n == 1`` too), so the scheduler and
  the attention have one rule; the single-request paths (jobs, samples, chat) keep the unshared
  layout and its unchanged kernels.

Why not paged (vLLM's block tables): a contiguous slot is what plain torch indexing reads exactly
on CPU and what a decode kernel reads with one base pointer per slot (two with shared prompts);
its cost is that every slot reserves its length however short its sequence, so a mix of short
and long sequences fits fewer at once than pages would. Sliding-window layers keep all positions
too (a ring buffer of the window is a later saving).

Shapes (legend): ``S`` own slots, ``P`` prompt slots, ``Hkv`` key/value heads, ``L`` positions
of an own slot, ``Lp`` positions of a prompt slot, ``D`` head dim, ``T`` tokens of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SharedPrompts:
    """The shared-prompt layout's shape (module docstring): ``slots`` prompts of up to
    ``prompt_len`` tokens held at once, and each sequence's own slot ``new_len`` positions."""

    slots: int
    """Prompts held at once: one per prefill whose choices still run (at most one per own slot)."""
    prompt_len: int
    """Positions of a prompt slot: the longest prompt the engine takes."""
    new_len: int
    """Positions of an own slot: the generated tokens a sequence may have at most."""

    def __post_init__(self) -> None:
        if self.slots < 1 or self.prompt_len < 1 or self.new_len < 1:
            raise ValueError(f"SharedPrompts: slots, prompt_len and new_len must be >= 1, got {self}")


class KVCache:
    """Per-layer keys and values of ``slots`` sequences (and, shared, ``prompts.slots`` prompts).

    Args:
        layers: decoder layers (one K and one V tensor each, per store).
        slots: sequences held at once.
        kv_heads, head_dim: the attention's key/value heads and head size.
        max_len: positions per own slot (unshared: prompt + generated tokens; shared: ``prompts.new_len``).
        dtype, device: of the stored keys and values (the dtype the attention projections produce).
        prompts: the shared-prompt layout's prompt store, or None (unshared).
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, prompts: SharedPrompts | None = None) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        # Zeroed once: a masked position's probability (0) still multiplies what the slot holds
        # there, which must be finite (stale keys of an earlier sequence are; uninitialised memory
        # may be NaN).
        self.keys_SHLD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values_SHLD = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.prompt_keys_PHLD: list[torch.Tensor] = []
        self.prompt_values_PHLD: list[torch.Tensor] = []
        if prompts is not None:
            prompt_shape = (prompts.slots, kv_heads, prompts.prompt_len, head_dim)
            self.prompt_keys_PHLD = [torch.zeros(prompt_shape, dtype=dtype, device=device) for _ in range(layers)]
            self.prompt_values_PHLD = [torch.zeros(prompt_shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots, self.prompts = slots, prompts
        self.max_len = max_len + (prompts.prompt_len if prompts is not None else 0)
        """The most positions a sequence reaches (its prompt's and its own)."""

    @classmethod
    def for_model(cls, config: Any, slots: int, max_len: int, dtype: torch.dtype,
                  device: torch.device | str, prompts: SharedPrompts | None = None) -> KVCache:
        """A cache shaped for a transformers ``config`` (its text config for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, slots, kv_heads, max_len, head_dim, dtype, device, prompts)

    @property
    def shape(self) -> tuple[int, ...]:
        """One layer's own store ``[S, Hkv, L, D]``."""
        return tuple(self.keys_SHLD[0].shape)

    @property
    def nbytes(self) -> int:
        stores = (*self.keys_SHLD, *self.values_SHLD, *self.prompt_keys_PHLD, *self.prompt_values_PHLD)
        return sum(t.numel() * t.element_size() for t in stores)

    def write(self, layer: int, slot_T: torch.Tensor, pos_T: torch.Tensor, key_THD: torch.Tensor,
              value_THD: torch.Tensor, prompt: bool = False) -> None:
        """Store each token's key and value at its slot and position (cast to the cache's dtype):
        of the own store, or of the prompt store with ``prompt``."""
        keys = (self.prompt_keys_PHLD if prompt else self.keys_SHLD)[layer]
        values = (self.prompt_values_PHLD if prompt else self.values_SHLD)[layer]
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
        prompt of ``n`` choices prefilled once, unshared layout)."""
        if not targets:
            return
        index = torch.tensor(targets, device=self.keys_SHLD[0].device)
        for tensor in (*self.keys_SHLD, *self.values_SHLD):
            rows = tensor[source, :, :length].unsqueeze(0).expand(len(targets), -1, -1, -1)
            tensor[:, :, :length].index_copy_(0, index, rows)
