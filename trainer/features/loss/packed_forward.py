"""The packed forward and loss: the only ways the trainer calls the model.

``packed_forward`` + ``loss_sum`` (full logits), ``packed_loss`` (either loss kernel; its
``loss_kernel`` is ``LOSS_FUSED`` or ``LOSS_PLAIN``), ``packed_sequence_logprobs`` (DPO's
per-sequence log-probabilities through either kernel). Packed rows must go in with no attention
mask and no KV cache: an all-ones mask (what a tokenizer or collator hands out by default) would
silently let every sample see the previous ones. ``packed_forward`` refuses such arguments
instead of passing them on.

The normal path (the plan's ``attention`` decision enabled): the model runs ``ftq_packed``
attention (``trainer.features.attention.packed``) and the call carries ``packed_metadata`` built once per
micro-batch from the host lengths; no mask is built at all.

The fallback, only for models packed attention cannot run (attention logit soft-capping,
bidirectional configs): transformers' own attention, which derives the per-sample block mask
from the restarting position ids when no mask and no cache are given. Some model classes do not
hand their position ids to the mask builder at all (GPT-OSS in transformers 5.23 builds its full
and sliding masks from the shapes alone, so stock packing leaks attention across samples there).
For every config with ``layer_types`` the trainer therefore builds the per-layer-type masks
itself with transformers' own mask functions and the packed position ids, and passes them as
the ``{layer_type: mask}`` mapping those models accept (``packed_attention_masks``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from trainer.objectives import token_accuracy
from trainer.data.dataset import IGNORE_INDEX
from trainer.data.packed_metadata import AnyPackedMetadata
from trainer.data.packing import PackedBatch

LOSS_FUSED, LOSS_PLAIN = "fused_chunked_ce", "torch_cross_entropy"
"""Loss kernels: ``trainer.features.loss.fused`` (chunked LM head + cross-entropy) or full logits (``loss_sum``)."""

_FORBIDDEN_PACKED_ARGS = ("attention_mask", "past_key_values", "use_cache", "labels")


def packed_forward(
    model: torch.nn.Module,
    batch: PackedBatch,
    meta: AnyPackedMetadata | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Logits [1, T, V] of a packed row, attention confined to each sample.

    Args:
        meta: the row's packed metadata when the model runs ``ftq_packed`` attention
            (``PackedAttention.metadata``); None for the model's own attention, which then gets
            the packed block masks (see the module docstring).

    Raises:
        ValueError: an ``attention_mask``, cache or ``labels`` argument was given; any of them would
            disable transformers' per-sample masking or the trainer's own loss.
    """
    bad = sorted(set(model_kwargs) & set(_FORBIDDEN_PACKED_ARGS))
    if bad:
        raise ValueError(
            f"packed_forward: {', '.join(bad)} must not be passed with packed rows: sample boundaries come from "
            "position_ids, and transformers ignores them when an attention mask or a cache is present"
        )
    out = model(
        input_ids=batch.input_ids,
        use_cache=False,
        **_boundary_kwargs(model, batch, meta),
        **model_kwargs,
    )
    return out.logits


def fused_packed_loss(
    model: torch.nn.Module, batch: PackedBatch, meta: AnyPackedMetadata | None, num_items: int
) -> torch.Tensor:
    """Summed token cross-entropy of a packed row divided by ``num_items``, through
    ``trainer.features.loss.fused`` (chunked LM head + cross-entropy: the logits are never materialised).

    Args:
        meta: as in ``packed_forward``.
        num_items: the label-token count of the whole optimizer step (a host int), so that the
            micro-batches of a gradient-accumulation group add up to the step's mean exactly;
            pass 1 for the plain sum.
    """
    from trainer.features.loss.fused import causal_lm_loss

    return causal_lm_loss(
        model,
        batch.input_ids,
        batch.targets,
        num_items=max(int(num_items), 1),
        **_boundary_kwargs(model, batch, meta),
    )


def plain_packed_loss(
    model: torch.nn.Module, batch: PackedBatch, meta: AnyPackedMetadata | None, num_items: int
) -> torch.Tensor:
    """As ``fused_packed_loss``, over the full logits in float32 (``loss_sum``)."""
    logits = packed_forward(model, batch, meta)
    targets_C = batch.targets.reshape(-1)
    token_accuracy.add(logits.reshape(-1, logits.shape[-1]), targets_C, targets_C != IGNORE_INDEX)
    return loss_sum(logits, batch.targets) / max(int(num_items), 1)


def packed_sequence_logprobs(
    model: torch.nn.Module, batch: PackedBatch, meta: Any, loss_kernel: str,
    sequences: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Each packed sequence's summed log p(target) over its label tokens, fp32 [S] (DPO, ``trainer.objectives.dpo``),
    through ``loss_kernel``: the fused chunked head (no logits materialised) or the full logits.
    ``sequences``: each position's sequence [T] on the device and their count, where the row's
    samples are not its sequences (shared prefixes); None: one sequence a sample."""
    device = batch.input_ids.device
    if sequences is not None:
        seq_T, num_seqs = sequences
    else:
        # Each sequence's positions restart at 0: its index is the count of starts so far, computed on
        # the device from the row already there (no host copy, no sync).
        num_seqs = len(batch.lengths)
        seq_T = (batch.position_ids[0] == 0).cumsum(0) - 1
    if loss_kernel == LOSS_FUSED:
        from trainer.objectives.fused_logprobs import causal_lm_sequence_logprobs

        return causal_lm_sequence_logprobs(
            model, batch.input_ids, batch.targets, seq_T.unsqueeze(0), num_seqs, **_boundary_kwargs(model, batch, meta)
        )
    logits = packed_forward(model, batch, meta)
    token_T = -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return torch.zeros(num_seqs, dtype=torch.float32, device=device).index_add_(0, seq_T, token_T)


def packed_token_logprobs(
    model: torch.nn.Module, batch: PackedBatch, meta: Any, loss_kernel: str
) -> torch.Tensor:
    """Each position's log p(target), fp32 [T] (0 where the target is ``IGNORE_INDEX``; GRPO's
    per-token ratios, ``trainer.objectives.grpo_loss``): ``packed_sequence_logprobs`` with every
    position its own sequence, so the fused head's backward takes one weight per token."""
    tokens = batch.input_ids.shape[-1]
    if loss_kernel == LOSS_FUSED:
        from trainer.objectives.fused_logprobs import causal_lm_sequence_logprobs

        index_T = torch.arange(tokens, device=batch.input_ids.device).unsqueeze(0)
        return causal_lm_sequence_logprobs(
            model, batch.input_ids, batch.targets, index_T, tokens, **_boundary_kwargs(model, batch, meta)
        )
    logits = packed_forward(model, batch, meta)
    return -F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction="none",
    )


LOSS_FUNCTIONS = {LOSS_FUSED: fused_packed_loss, LOSS_PLAIN: plain_packed_loss}
"""Loss kernel (the plan's ``loss`` decision) -> its function; a run picks one once
(``trainer.features.loss.feature``)."""


def packed_loss(
    model: torch.nn.Module,
    batch: PackedBatch,
    meta: AnyPackedMetadata | None,
    loss_kernel: str,
    num_items: int,
) -> torch.Tensor:
    """The loss of ``loss_kernel`` by name, for tests and benches that compare the kernels.

    Raises:
        ValueError: an unknown kernel name.
    """
    if loss_kernel not in LOSS_FUNCTIONS:
        raise ValueError(f"loss kernel {loss_kernel!r} is not one of {', '.join(LOSS_FUNCTIONS)}")
    return LOSS_FUNCTIONS[loss_kernel](model, batch, meta, num_items)


def _boundary_kwargs(
    model: torch.nn.Module, batch: PackedBatch, meta: AnyPackedMetadata | None
) -> dict[str, Any]:
    """What tells the model where samples begin: packed metadata, or positions + block masks."""
    if meta is not None:
        return meta.model_kwargs()
    kwargs: dict[str, Any] = {"position_ids": batch.position_ids}
    masks = packed_attention_masks(model, batch)
    if masks is not None:
        kwargs["attention_mask"] = masks
    return kwargs


def packed_attention_masks(
    model: torch.nn.Module, batch: PackedBatch
) -> dict[str, Any] | None:
    """Per-layer-type attention masks honouring the packed boundaries, or None to let the model build them.

    Built for configs with ``layer_types`` (their models take a ``{layer_type: mask}`` mapping);
    None for the others, whose models pass ``position_ids`` to the mask builder themselves (the
    packed-vs-per-sample tests hold each supported architecture to that).
    """
    from transformers import masking_utils

    config = model.config
    layer_types = getattr(config, "layer_types", None)
    builders = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }
    if not layer_types or not set(layer_types) <= set(builders):
        return None
    embed = model.get_input_embeddings().weight
    # Only shape, dtype and device of the embeddings are read; expand() allocates nothing.
    embeds_like = torch.empty(
        1, 1, 1, dtype=embed.dtype, device=batch.input_ids.device
    ).expand(1, batch.input_ids.shape[1], config.hidden_size)
    masks = {}
    for layer_type in set(layer_types):
        build = builders[layer_type]
        params = inspect.signature(build).parameters
        embeds_name = (
            "inputs_embeds" if "inputs_embeds" in params else "input_embeds"
        )  # renamed within 5.x
        # The KV cache argument is `cache` from transformers 5.24 on; `past_key_values` before
        # (5.24 still takes it but warns that 5.40 drops it).
        cache_name = "cache" if "cache" in params else "past_key_values"
        kwargs: dict[str, Any] = {
            "config": config,
            embeds_name: embeds_like,
            "attention_mask": None,
            cache_name: None,
            "position_ids": batch.position_ids,
        }
        if "cache_position" in params:  # older 5.x releases still take it
            kwargs["cache_position"] = torch.arange(
                batch.input_ids.shape[1], device=batch.input_ids.device
            )
        masks[layer_type] = build(**kwargs)
    return masks


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32; ``targets`` are pre-shifted, -100 = no loss.

    Args:
        logits: [1, T, V].
        targets: [1, T].
    Returns:
        A scalar: divide by the step's target count for the mean.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
