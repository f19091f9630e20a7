"""The sampler's attention: the stock model's attention modules, reading and writing the KV cache.

Why a registered attention function and not a second model: the sampler runs the very model the
trainer trains (peft with unmerged adapters, the fused LoRA layers, the fused ops, FSDP2 shards)
by switching it to ``ftq_sampler`` with ``model.set_attn_implementation`` for the length of a
``generate`` call (``sampler_attention``). transformers threads the extra forward kwarg
``sampler_state`` from ``XForCausalLM.forward`` through every decoder layer into this function,
as it threads ``packed_metadata`` for training (``trainer.features.attention.packed``); the
model's own code computes the projections, q/k norms and RoPE at the ``position_ids`` given.

Each forward is one packed row of tokens, each with a slot and a position (``StepState``): a
prefilled prompt is a run of tokens of one slot at positions ``0..n-1``; a decoding sequence is
one token at its slot's current length. The function writes every token's key and value into
the cache at ``[slot, :, position]`` (``module.layer_idx`` picks the layer; in the shared-prompt
layout of ``trainer.generate.cache``, a position below the sequence's prompt length goes to
``[prompt slot, :, position]`` of the prompt store, the rest to ``[slot, :, position - prompt
length]``), then lets each query attend to its sequence's cached keys up to and including its
position, wherever they are stored (the torch backend gathers both stores into position order
first, so its fp32 ops and results are the unshared layout's bit for bit): causal, within the
layer's ``sliding_window`` (a token sees ``sliding_window`` positions, itself included, as
transformers' ``sliding_window_overlay``), with GPT-OSS sinks (``s_aux``: one extra logit per
head in the softmax denominator, no value) and Gemma 2's logit soft-capping. No attention mask
is passed or built: transformers returns ``None`` from mask creation for an implementation that
has no mask function (see ``trainer.features.attention.packed``).

Backends (``BACKENDS``; ``choose_backend`` picks one per engine, ``StepState.backend`` carries it):

- ``torch``: plain ops, scores and softmax in fp32: exact on CPU, the reference and the CPU path.
  On CUDA it is slow: each layer gathers the step's slots' keys and values up to the longest
  position and upcasts them (batch 256 x 512 positions: ~1 GB per layer per step).
- ``triton`` (``auto``'s choice on CUDA when Triton imports): the decoding group (every sequence
  of one token) runs ``trainer.kernels.decode_attention``, which reads the slot-major cache in
  place through the slots and each sequence's length (flash-decoding, split-K for few long
  sequences; GQA, sliding window, sinks and soft-capping in the kernel). A prefilled prompt that
  starts at position 0 without sinks, window or soft-capping runs
  ``scaled_dot_product_attention(is_causal=True)`` on its own keys and values in the input dtype
  (FlashAttention on CUDA); two or more such prompts in one step (``StepState.prefill``) run
  instead as one packed batch through the trainer's varlen kernel
  (``trainer.kernels.attention.flash_varlen_attention``, head dims 64 and 128), with the layer's
  window and sinks: one kernel call per layer for every prompt the step admits. Everything else (a prompt after a cached prefix, a sink or window
  or soft-capping layer's prefill, a cache dtype or head dim the kernel refuses) falls back to
  the ``torch`` path for that group.

Shapes (legend): ``T`` tokens of the row, ``Hq``/``Hkv`` query/kv heads, ``G = Hq / Hkv``,
``D`` head dim, ``S`` sequences of a group, ``N`` queries per sequence of a group, ``L`` keys
read per sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.features.attention.packed import unwrap_model
from trainer.generate.cache import KVCache
from trainer.generate.prefill import Prefill, attend_prefill, plan_prefill
from trainer.generate.transfer import to_device

ATTN_IMPLEMENTATION = "ftq_sampler"
"""The name registered with transformers' ``AttentionInterface``."""
BACKENDS = ("torch", "triton")
"""What ``StepState.backend`` may name (see the module docstring); ``auto`` picks one of them."""
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class Group:
    """Sequences attended in one batched computation: ``S`` sequences of ``N`` queries each
    (every decoding sequence together, ``N = 1``; each prefilled prompt alone, ``S = 1``)."""

    rows: torch.Tensor
    """[S * N] the queries' indices in the packed row, sequence-major."""
    slots: torch.Tensor
    """[S] each sequence's own cache slot."""
    positions_SN: torch.Tensor
    """[S, N] each query's position in its sequence."""
    size: tuple[int, int]
    """(S, N) on the host."""
    kv_len: int
    """Keys read per sequence: the largest position of the group plus one (host)."""
    lengths: torch.Tensor
    """[S] int32 (int64 in ``trainer.generate.graphs.DecodeGraphs``) each sequence's keys after this step (last position + 1)."""
    prompt_slots: torch.Tensor | None = None
    """[S] each sequence's prompt slot (shared-prompt layout; 0 where it has none), or None: no
    sequence of the group reads the prompt store."""
    prompt_lens: torch.Tensor | None = None
    """[S] int32 positions each sequence reads from its prompt slot (0: none), or None as above."""


@dataclass(frozen=True)
class Writes:
    """Where a forward's keys go in one store: ``rows`` of the packed row (None: every token, in
    order) to ``[slots, :, positions]``."""

    rows: torch.Tensor | None
    slots: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True)
class StepState:
    """One forward's tokens for the cache (the ``sampler_state`` kwarg), built once per step."""

    cache: KVCache
    slot_T: torch.Tensor
    """[T] each token's own slot."""
    position_T: torch.Tensor
    """[T] each token's position (also the model's ``position_ids``)."""
    groups: tuple[Group, ...]
    backend: str = "torch"
    own: Writes | None = None
    """The own store's writes; None: every token at ``[slot_T, :, position_T]`` (unshared layout)."""
    prompt: Writes | None = None
    """The prompt store's writes (the shared layout's prefilled prompts), or None."""
    prefill: Prefill | None = None
    """The step's prompts as one varlen batch (``triton``: one kernel call per layer for all of
    them), or None when the step has fewer than two."""
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, cache: KVCache, segments: list[tuple[int, int, int]], device: torch.device,
              backend: str = "torch", prompts: list[tuple[int, int]] | None = None) -> StepState:
        """The state of a row made of ``segments``, each ``(slot, first_position, tokens)`` in row order,
        attended by ``backend`` (one of ``BACKENDS``). ``prompts``: each segment's ``(prompt slot,
        prompt length)`` in the shared-prompt layout (``trainer.generate.cache``), positions below the
        prompt length being the prompt store's; None: the unshared layout.

        One host-to-device copy of the row's slots and positions (and writes); no device read.
        """
        prompts = prompts or [(-1, 0)] * len(segments)
        slots, positions, singles, groups, row = [], [], [], [], 0
        own_w, prompt_w = ([], [], []), ([], [], [])  # (rows, slots, positions) of each store's writes
        for (slot, start, count), (prompt_slot, prompt_len) in zip(segments, prompts):
            slots += [slot] * count
            positions += range(start, start + count)
            # positions [start, split) go to the prompt store, [split, start + count) to the own slot
            split = min(max(start, prompt_len), start + count)
            _route(prompt_w, range(row, row + split - start), prompt_slot, range(start, split))
            _route(own_w, range(row + split - start, row + count), slot,
                   range(split - prompt_len, start + count - prompt_len))
            member = (row, slot, start, max(prompt_slot, 0), prompt_len)
            if count == 1:
                singles.append(member)
            else:
                groups.append(_group([member], count, device))
            row += count
        if singles:
            groups.insert(0, _group(singles, 1, device))
        if max(positions, default=-1) >= cache.max_len:
            raise ValueError(f"position {max(positions)} is past the cache's max_len {cache.max_len}")
        shared = any(length for _, length in prompts)
        host = [slots, positions, *(own_w + prompt_w if shared else ())]
        flat = to_device([v for column in host for v in column], torch.long, device)
        parts = flat.split([len(column) for column in host])
        own = Writes(parts[2], parts[3], parts[4]) if shared else None
        prompt = Writes(parts[5], parts[6], parts[7]) if shared and prompt_w[0] else None
        prefill = plan_prefill(segments, len(singles) > 0, device) if backend == "triton" else None
        return cls(cache, parts[0], parts[1], tuple(groups), backend, own, prompt, prefill)

    def allowed(self, index: int, window: int | None) -> torch.Tensor:
        """[S, 1, 1, N, L] which cached keys group ``index``'s queries see (memoized per window:
        every layer of the step shares it)."""
        mask = self._masks.get((index, window))
        if mask is None:
            group = self.groups[index]
            key_L = torch.arange(group.kv_len, device=group.positions_SN.device)
            query_SN1 = group.positions_SN.unsqueeze(-1)
            mask = key_L <= query_SN1
            if window is not None:
                mask &= key_L > query_SN1 - window
            mask = self._masks[(index, window)] = mask[:, None, None]
        return mask

    def write(self, layer: int, key_THD: torch.Tensor, value_THD: torch.Tensor) -> None:
        """The step's keys and values into the cache (each store its tokens)."""
        own = self.own or Writes(None, self.slot_T, self.position_T)
        for store, prompt in ((own, False), (self.prompt, True)):
            if store is None:
                continue
            keys, values = (t if store.rows is None else t.index_select(0, store.rows) for t in (key_THD, value_THD))
            self.cache.write(layer, store.slots, store.positions, keys, values, prompt=prompt)


def _route(writes: tuple[list[int], list[int], list[int]], rows: range, slot: int, positions: range) -> None:
    """Append tokens ``rows`` of one sequence, to be written at ``[slot, :, positions]``, to ``writes``."""
    writes[0].extend(rows)
    writes[1].extend([slot] * len(rows))
    writes[2].extend(positions)


def _group(members: list[tuple[int, int, int, int, int]], count: int, device: torch.device) -> Group:
    """A group of ``members`` ``(row, slot, first_position, prompt slot, prompt length)`` of ``count`` tokens each."""
    rows = [r + i for r, *_ in members for i in range(count)]
    positions = [[m[2] + i for i in range(count)] for m in members]
    lengths = [m[2] + count for m in members]
    prompt_slots = prompt_lens = None
    if any(m[4] for m in members):
        prompt_slots = to_device([m[3] for m in members], torch.long, device)
        prompt_lens = to_device([m[4] for m in members], torch.int32, device)
    return Group(to_device(rows, torch.long, device), to_device([m[1] for m in members], torch.long, device),
                 to_device(positions, torch.long, device), (len(members), count), max(lengths),
                 to_device(lengths, torch.int32, device), prompt_slots, prompt_lens)


def choose_backend(requested: str, device: torch.device) -> str:
    """The backend ``requested`` (``auto`` or one of ``BACKENDS``) resolves to on ``device``.

    ``auto`` is ``triton`` on a CUDA device where the kernel runs (Triton imports, Ampere or
    later), else ``torch``; ``triton`` on the CPU runs only under Triton's interpreter (tests).

    Raises:
        ValueError: an unknown name, or ``triton`` where it cannot run (the reason given).
    """
    from trainer.kernels import decode_attention

    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"sampler attention backend {requested!r} is not one of auto, {', '.join(BACKENDS)}")
    reason = decode_attention.supported(device, torch.bfloat16, 128)
    if requested == "triton" and reason is not None:
        raise ValueError(f"sampler attention backend triton cannot run: {reason}; use torch (or auto)")
    if requested == "auto":
        return "triton" if reason is None and device.type == "cuda" else "torch"
    return requested


def register() -> None:
    """Register ``ftq_sampler`` with transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sampler_attention_forward)


@contextmanager
def sampler_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` (a transformers model, or peft around one) on ``ftq_sampler`` attention
    inside the block; its previous implementation is restored after.

    Raises:
        ValueError: the model cannot run it (``model_reason`` says why), or does not switch.
    """
    register()
    lm = unwrap_model(model)
    reason = model_reason(lm.config)
    if reason is not None:
        raise ValueError(f"the sampler cannot run {type(lm).__name__}: {reason}")
    previous = lm.config._attn_implementation
    lm.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        if lm.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"{type(lm).__name__} does not take a registered attention implementation "
                "(transformers' AttentionInterface); the sampler cannot run it"
            )
        yield
    finally:
        lm.set_attn_implementation(previous or "sdpa")


def model_reason(config: Any) -> str | None:
    """Why the sampler cannot run a model of ``config``, or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported (decoder-only causal LMs are)"
    if getattr(text, "use_bidirectional_attention", False) or not getattr(text, "is_causal", True):
        return f"{text.model_type} is configured for bidirectional attention; the sampler is causal"
    other = set(getattr(text, "layer_types", None) or ()) - _ATTENTION_LAYERS
    if other:
        return (f"layers of type {', '.join(sorted(other))} keep a state other than keys and values, "
                "which the sampler's cache does not hold")
    if getattr(text, "attention_chunk_size", None):
        return "chunked attention (attention_chunk_size) is not implemented"
    return None


def sampler_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sampler_state: StepState | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the sampler's cache.

    Args:
        query: [1, Hq, T, D]; key, value: [1, Hkv, T, D] (RoPE applied); or, with the tokens as
            the batch (the engine's several-adapter layout), [T, Hq, 1, D] and [T, Hkv, 1, D].
        attention_mask: must be None (boundaries come from ``sampler_state``).
        sliding_window: the layer's window, or None.
        s_aux: GPT-OSS per-head sink logits [Hq].
        sampler_state: the step's ``StepState``.

    Returns:
        ``(out [1, T, Hq, D], None)`` (``[T, 1, Hq, D]`` for tokens as the batch).
    """
    if sampler_state is None or attention_mask is not None or dropout:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} attention needs sampler_state, no attention_mask and no dropout "
            f"(got state={sampler_state is not None}, mask={attention_mask is not None}, dropout={dropout}); "
            "only trainer.generate.engine.Engine calls the model with it"
        )
    batch, heads_q, length, head_dim = query.shape
    if 1 not in (batch, length) or batch * length != sampler_state.slot_T.shape[0]:
        raise ValueError(
            f"the sampler expects {sampler_state.slot_T.shape[0]} tokens as one row or as the batch, "
            f"got query {tuple(query.shape)}"
        )
    layer = module.layer_idx
    state = sampler_state
    # [B, H, S, D] -> [B * S, H, D]: one of B and S is 1, so this is the tokens in row order.
    key_THD, value_THD = (t.transpose(1, 2).reshape(-1, t.shape[1], head_dim) for t in (key, value))
    state.write(layer, key_THD, value_THD)
    scale = scaling if scaling is not None else head_dim**-0.5
    query_THD = query.transpose(1, 2).reshape(-1, heads_q, head_dim)
    out_THD = attend_cached(state, layer, query_THD, key_THD, value_THD, scale, sliding_window, s_aux, softcap)
    return out_THD.view(batch, length, heads_q, head_dim), None


def attend_cached(state: StepState, layer: int, query_THD: torch.Tensor, key_THD: torch.Tensor,
                  value_THD: torch.Tensor, scale: float, window: int | None, sinks: torch.Tensor | None,
                  softcap: float | None) -> torch.Tensor:
    """Each query against its slot's cached keys (the cache already holds this step's): [T, Hq, D].

    ``key_THD``/``value_THD`` are the step's own keys and values (``triton``'s prefill reads
    them instead of the cache). ``state.backend`` picks the path per group (module docstring).
    """
    if state.backend not in BACKENDS:
        raise ValueError(f"sampler attention backend {state.backend!r} is not one of {', '.join(BACKENDS)}")
    query_THD = query_THD.contiguous()
    out_THD = torch.empty_like(query_THD)
    batched = attend_prefill(state.prefill, state.cache.keys_SHLD[0].dtype, query_THD, key_THD, value_THD, out_THD,
                             scale, window, sinks, softcap)
    for index, group in enumerate(state.groups):
        if index in batched:
            continue
        if state.backend == "triton" and _attend_decoding(state, layer, index, query_THD, out_THD, scale,
                                                          window, sinks, softcap):
            continue
        if state.backend == "triton" and _is_plain_prefill(group, window, sinks, softcap):
            out = _prefill_sdpa(group, query_THD, key_THD, value_THD, scale)
        else:
            out = _attend_group(state, layer, index, query_THD, scale, window, sinks, softcap)
        out_THD.index_copy_(0, group.rows, out)
    return out_THD


def _attend_decoding(state: StepState, layer: int, index: int, query_THD: torch.Tensor, out_THD: torch.Tensor,
                     scale: float, window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> bool:
    """Run the decode kernel for group ``index`` into ``out_THD`` when it is a decoding group the
    kernel takes; False (nothing written) otherwise."""
    from trainer.kernels import decode_attention

    group = state.groups[index]
    keys, values = state.cache.keys_SHLD[layer], state.cache.values_SHLD[layer]
    if group.size[1] != 1 or keys.dtype != query_THD.dtype:
        return False
    if decode_attention.supported(keys.device, keys.dtype, keys.shape[-1]) is not None:
        return False
    prompt = None
    if group.prompt_slots is not None:
        prompt = (state.cache.prompt_keys_PHLD[layer], state.cache.prompt_values_PHLD[layer], group.prompt_slots,
                  group.prompt_lens)
    decode_attention.decode_attention(query_THD, keys, values, group.rows, group.slots, group.lengths, out_THD,
                                      scale, group.kv_len, window=window, sinks_Hq=sinks, softcap=softcap,
                                      prompt=prompt)
    return True


def _is_plain_prefill(group: Group, window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> bool:
    """A single prompt from position 0 whose layer needs nothing SDPA lacks (its keys are the step's own)."""
    seqs, count = group.size
    return seqs == 1 and count > 1 and group.kv_len == count and window is None and sinks is None and softcap is None


def _prefill_sdpa(group: Group, query_THD: torch.Tensor, key_THD: torch.Tensor, value_THD: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """A prompt's causal attention over its own keys in the input dtype: [N, Hq, D]."""
    q_HND, k_HND, v_HND = (t.index_select(0, group.rows).transpose(0, 1).to(query_THD.dtype)
                           for t in (query_THD, key_THD, value_THD))
    out_HND = torch.nn.functional.scaled_dot_product_attention(
        q_HND.unsqueeze(0), k_HND.unsqueeze(0), v_HND.unsqueeze(0), is_causal=True, scale=scale,
        enable_gqa=k_HND.shape[0] != q_HND.shape[0])
    return out_HND[0].transpose(0, 1)


def _gather(cache: KVCache, layer: int, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's sequences' keys and values at their positions ``0..kv_len-1``: [S, Hkv, L, D] each.

    In the shared-prompt layout position ``p`` of a sequence is its prompt slot's ``p`` below its
    prompt length, else its own slot's ``p - prompt length``: gathered into the unshared layout's
    order and made contiguous, so the fp32 ops after are the unshared path's on the same values
    (positions past a sequence's length hold other finite keys, masked out as there).
    """
    own = cache.keys_SHLD[layer], cache.values_SHLD[layer]
    if group.prompt_slots is None:
        return tuple(t[:, :, : group.kv_len].index_select(0, group.slots) for t in own)
    prompt = cache.prompt_keys_PHLD[layer], cache.prompt_values_PHLD[layer]
    key_L = torch.arange(group.kv_len, device=group.slots.device)
    prompt_len_S1 = group.prompt_lens.long().unsqueeze(1)
    in_prompt_SL11 = (key_L < prompt_len_S1)[:, :, None, None]
    own_pos_SL = (key_L - prompt_len_S1).clamp(0, own[0].shape[2] - 1)
    prompt_pos_SL = key_L.clamp(max=prompt[0].shape[2] - 1).expand_as(own_pos_SL)
    out = []
    for own_t, prompt_t in zip(own, prompt):
        # Advanced indices around a slice put the indexed dimensions first: [S, L, Hkv, D].
        mixed_SLHD = torch.where(in_prompt_SL11, prompt_t[group.prompt_slots.unsqueeze(1), :, prompt_pos_SL],
                                 own_t[group.slots.unsqueeze(1), :, own_pos_SL])
        out.append(mixed_SLHD.transpose(1, 2).contiguous())
    return out[0], out[1]


def _attend_group(state: StepState, layer: int, index: int, query_THD: torch.Tensor, scale: float,
                  window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """One group's attention in fp32: [S * N, Hq, D] in the query's dtype."""
    group = state.groups[index]
    (seqs, count), heads_q, head_dim = group.size, query_THD.shape[1], query_THD.shape[2]
    keys, values = _gather(state.cache, layer, group)
    heads_kv = keys.shape[1]
    # Query head h reads key head h // G (transformers' repeat_kv): view the heads as [Hkv, G].
    q_SHGND = query_THD.index_select(0, group.rows).view(seqs, count, heads_kv, heads_q // heads_kv, head_dim)
    q_SHGND = q_SHGND.permute(0, 2, 3, 1, 4)
    scores = torch.matmul(q_SHGND.float(), keys.float().unsqueeze(2).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~state.allowed(index, window), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, heads_kv, -1, 1, 1).expand(seqs, -1, -1, count, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out_SHGND = torch.matmul(probs.to(values.dtype), values.unsqueeze(2))
    return out_SHGND.permute(0, 3, 1, 2, 4).reshape(seqs * count, heads_q, head_dim).to(query_THD.dtype)
