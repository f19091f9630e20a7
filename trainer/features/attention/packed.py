"""Packed varlen attention for stock transformers models (Llama, Qwen3, Mistral, Gemma, GPT-OSS).

Why: with packed position ids, stock transformers builds one dense ``T x T`` mask per forward
and SDPA computes every block of it (97% masked at 16k tokens of ~250-token samples). This
module registers an attention function, ``ftq_packed``, with transformers'
``AttentionInterface``; ``PackedAttention.install(model)`` switches a loaded model to it with
``model.set_attn_implementation`` (transformers 5.17 and 5.23 both accept registered names),
and the model's own attention modules then call it in every layer.

How the metadata reaches the layers: ``meta.model_kwargs()`` adds ``packed_metadata=meta`` (and
the packed ``position_ids``) to the model call. transformers threads unknown forward kwargs
(``**kwargs: Unpack[TransformersKwargs]``) from ``XForCausalLM.forward`` through the decoder
model, every ``GradientCheckpointingLayer`` (which checkpoints ``partial(forward, **kwargs)``,
so the recompute sees the very same object) and the attention module into the attention
function; peft's ``LoraModel.forward`` passes them on unchanged. Tested for all five models,
with gradient checkpointing and peft, in ``tests/unit/trainer/features/attention/test_attention.py``.

Why no ``AttentionMaskInterface`` entry: ``masking_utils._preprocess_mask_arguments`` returns
``None`` at once for an implementation that has no mask function ("custom attention without
equivalent mask creation"), before it looks at position ids. Registering a mask function would
make transformers run ``find_packed_sequence_indices`` on every forward (a host sync, ``.all()``
on a device tensor) to build a mask we do not use. The cost of that early exit: a 2D
``attention_mask`` is dropped silently; so ``install`` adds a forward pre-hook to the decoder
model that rejects any ``attention_mask`` next to ``packed_metadata`` (an all-ones mask is the
classic way packing silently cross-attends in stock transformers, PR #46634) and sets
``use_cache=False`` (stock transformers also skips packed detection whenever the model made
itself a ``DynamicCache``, i.e. with the config's default ``use_cache=True``).

Backends (one per batch, carried by the metadata, chosen by ``trainer.plan.hardware``'s plan):

- ``triton``: ``trainer.kernels.attention`` (CUDA; never computes a cross-sample block).
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.12, CUDA only).
- ``flex``: flex attention with a document-causal ``BlockMask`` (compiled on CUDA; the first
  step compiles for a long time, so it is never auto-picked; CPU runs it eagerly, forward only:
  torch has no flex backward on CPU, and no log-sum-exp there for sinks).
- ``sdpa``: SDPA with the cached block-diagonal boolean mask (O(T^2) memory; the CPU path and
  the reference the others are tested against).

Model specifics: GQA (``Hq % Hkv == 0``), causal only (a bidirectional Gemma config is refused),
``sliding_window`` per layer (Mistral, GPT-OSS), GPT-OSS attention sinks (``s_aux``: one extra
logit per head in the softmax denominator, no value), Gemma's scaling (passed as ``scaling``).
Attention logit soft-capping (Gemma 2) is refused: none of the varlen kernels implements it.

Shapes (legend): ``B`` rows (1), ``T`` packed tokens, ``Hq``/``Hkv`` query/kv heads, ``D`` head dim.
transformers passes ``query_BHTD`` / ``key_BHTD`` and expects ``[B, T, Hq, D]`` back.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.features.attention.backends import attend
from trainer.data.packed_metadata import BACKENDS, AnyPackedMetadata, build_packed_metadata

ATTN_IMPLEMENTATION = "ftq_packed"
"""The name registered with transformers' ``AttentionInterface``."""

# -- the optimization object ---------------------------------------------------------------------


class PackedAttention:
    """Packed attention with (or without) the per-batch metadata cache.

    Args:
        backend: one of ``BACKENDS`` (``trainer.features.attention.feature.choose`` picks it).
        cache: True builds the metadata once per batch; False is the rebuild-per-layer twin.

    The loop::

        attn = PackedAttention(backend, cache=True)
        attn.install(model)                                  # once, after peft wrapping is fine too
        meta = attn.metadata(batch.lengths, device)          # once per packed micro-batch
        out = model(input_ids=ids, **meta.model_kwargs())    # no attention_mask
    """

    def __init__(self, backend: str = "sdpa", cache: bool = True) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.cache = cache
        self._installed: list[tuple[Any, str | None, Any]] = []

    def install(self, model: torch.nn.Module) -> None:
        """Switch ``model`` (an HF model, or a peft model around one) to ``ftq_packed`` attention.

        Raises:
            ValueError: the model's config is one this attention cannot run (the reason says why).
        """
        register()
        lm = unwrap_model(model)
        reason = model_reason(lm.config)
        if reason is not None:
            raise ValueError(
                f"packed attention cannot run {type(lm).__name__}: {reason}"
            )
        previous = lm.config._attn_implementation
        lm.set_attn_implementation(ATTN_IMPLEMENTATION)
        decoder = getattr(lm, lm.base_model_prefix, lm)
        hook = decoder.register_forward_pre_hook(_guard_packed_call, with_kwargs=True)
        self._installed.append((lm, previous, hook))

    def uninstall(self) -> None:
        """Restore the attention implementations ``install`` replaced (tests compare both)."""
        while self._installed:
            lm, previous, hook = self._installed.pop()
            hook.remove()
            lm.set_attn_implementation(previous or "sdpa")

    def metadata(self, lengths: Any, device: torch.device | str, prefixes: Any = None) -> AnyPackedMetadata:
        """Build one packed row's metadata (see ``trainer.data.packed_metadata.build_packed_metadata``)."""
        return build_packed_metadata(
            lengths, device, backend=self.backend, cache=self.cache, prefixes=prefixes
        )


def register() -> None:
    """Register ``ftq_packed`` with transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)


def unwrap_model(model: torch.nn.Module) -> Any:
    """The transformers ``PreTrainedModel`` inside ``model`` (peft's ``PeftModel`` unwrapped)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(inner, "set_attn_implementation"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers model (no set_attn_implementation)"
        )
    return inner


def _guard_packed_call(
    module: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """Forward pre-hook on the decoder model: a packed call takes no mask and no KV cache."""
    if kwargs.get("packed_metadata") is None:
        return None
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is not None:
        raise ValueError(
            "packed batches must not pass attention_mask: sample boundaries come from packed_metadata, "
            "and transformers would drop (or, stock, misread) the mask; call the model with "
            "input_ids and **meta.model_kwargs() only"
        )
    if kwargs.get("past_key_values") is not None:
        raise ValueError(
            "packed batches cannot use a KV cache (past_key_values); pass none"
        )
    # With use_cache (the config default) the model creates a DynamicCache and every layer
    # stores its keys/values in it for nothing; stock transformers also stops detecting packed
    # rows when a cache exists (masking_utils._preprocess_mask_arguments).
    return args, {**kwargs, "use_cache": False}


# -- the attention function ----------------------------------------------------------------------


def packed_attention_forward(
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
    packed_metadata: AnyPackedMetadata | None = None,
    position_ids: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over packed metadata.

    Args:
        query: [B, Hq, T, D]; key, value: [B, Hkv, T, D].
        attention_mask: must be None (a 4D mask would be a custom mask this cannot honour).
        sliding_window: transformers' window (a token sees ``sliding_window`` tokens, itself included).
        s_aux: GPT-OSS per-head sink logits [Hq].
        packed_metadata: from ``meta.model_kwargs()``.
        position_ids: the layer's device position ids (the cache-off twin rebuilds from them).

    Returns:
        ``(out [B, T, Hq, D], None)``.
    """
    _check_call(module, attention_mask, softcap, packed_metadata)
    meta = packed_metadata.layer_view(position_ids)
    batch, heads_q, total, head_dim = query.shape
    if batch != 1 or total != meta.total:
        raise ValueError(
            f"packed attention expects one packed row of {meta.total} tokens, got query shape {tuple(query.shape)}"
        )
    if heads_q % key.shape[1]:
        raise ValueError(
            f"query heads ({heads_q}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    if dropout and meta.backend != "sdpa":
        raise ValueError(
            f"attention dropout ({dropout}) is only supported by the sdpa backend; set it to 0"
        )
    if sliding_window is not None and sliding_window < meta.total and getattr(meta, "prefix_of", None) is not None:
        raise ValueError(
            "shared prefixes with a sliding-window layer: a prefix is seen whole, so this batch must pack "
            "whole sequences (windowed_attention(model) should have said so)"
        )
    window = (
        sliding_window
        if sliding_window is not None and sliding_window < meta.max_seqlen
        else None
    )
    scale = scaling if scaling is not None else head_dim**-0.5
    out_BTHD = attend(meta, query, key, value, scale, window, s_aux, dropout)
    return out_BTHD, None


def _check_call(
    module: torch.nn.Module,
    attention_mask: torch.Tensor | None,
    softcap: float | None,
    packed_metadata: AnyPackedMetadata | None,
) -> None:
    """Refuse a call ``packed_attention_forward`` cannot honour (the message says what to change)."""
    if packed_metadata is None:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} attention needs packed_metadata: call the model with "
            "**meta.model_kwargs() (trainer.data.packed_metadata.build_packed_metadata), or uninstall it"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} attention takes no attention_mask; boundaries come from packed_metadata"
        )
    if softcap is not None:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} attention does not implement logit soft-capping (softcap={softcap})"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} attention is causal only; {type(module).__name__} is bidirectional"
        )


# -- model checks --------------------------------------------------------------------------------


def model_reason(config: Any) -> str | None:
    """Why ``config`` describes a model packed attention cannot run, or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        return (
            f"{text.model_type} soft-caps attention logits (attn_logit_softcapping={softcap}), which no "
            "packed backend implements; set the switch to off for this model"
        )
    if getattr(text, "use_bidirectional_attention", False) or not getattr(
        text, "is_causal", True
    ):
        return f"{text.model_type} is configured for bidirectional attention; packed attention is causal only"
    return None


def head_dim(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return head_dim


def has_sinks(config: Any) -> bool:
    return getattr(config, "model_type", None) == "gpt_oss"


def windowed_attention(model: torch.nn.Module) -> bool:
    """Whether an attention layer of ``model`` may pass a binding sliding window to the attention
    function: one whose own ``sliding_window`` is set, or that reads the config's (Mistral, Phi-3,
    Starcoder2 and their kin have no per-layer attribute), shorter than the model's positions (Phi-3's
    128k configs carry a window of 262,143 that never binds). Shared prefixes are refused with it."""
    lm = unwrap_model(model)
    text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    default = getattr(text, "sliding_window", None)
    positions = getattr(text, "max_position_embeddings", None)

    def binds(window: int | None) -> bool:
        return window is not None and not (isinstance(positions, int) and window >= positions)

    layers = [m for m in lm.modules() if hasattr(m, "o_proj") and type(m).__name__.endswith("Attention")]
    return any(binds(getattr(m, "sliding_window", default)) for m in layers) or (not layers and binds(default))


def uses_window(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "sliding_window", None) is not None and (
        "sliding_attention" in (getattr(text, "layer_types", None) or ())
        or text.model_type == "mistral"
    )
