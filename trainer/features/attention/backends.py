"""The per-backend attention calls behind ``trainer.features.attention.packed.packed_attention_forward``.

One function per backend of ``trainer.data.packed_metadata.BACKENDS``, all with one signature
``(meta, q, k, v, scale, window, sinks, dropout) -> [1, T, Hq, D]``; ``attend`` picks the one
named by ``meta.backend``. What each backend is and where it runs: ``trainer.features.attention.packed``'s
module docstring. ``sdpa`` is the reference the others are tested against.

Shapes (legend): ``T`` packed tokens, ``Hq``/``Hkv`` query/kv heads, ``D`` head dim; q, k, v
arrive as ``[1, H, T, D]``; the varlen kernels take ``[T, H, D]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from trainer.data.packed_metadata import PackedMetadata


def _sdpa(
    meta: PackedMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    _, heads_q, total, head_dim = q.shape
    k, v = _repeat_kv(k, heads_q), _repeat_kv(v, heads_q)
    if sinks is None:
        mask = meta.dense_mask(window, q.device)
    else:
        # A sink is a key whose score is s_aux[h] and whose value is 0: one extra column,
        # added through the (additive) mask on a zero key/value row.
        base_11TT = meta.additive_mask(window, q.device, q.dtype)
        sink_1HT1 = (
            sinks.to(q.dtype).view(1, heads_q, 1, 1).expand(1, heads_q, total, 1)
        )
        mask = torch.cat(
            [base_11TT.expand(1, heads_q, total, total), sink_1HT1], dim=-1
        )
        zero = q.new_zeros(1, heads_q, 1, head_dim)
        k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    out_BHTD = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale
    )
    return out_BHTD.transpose(1, 2)


def _flex(
    meta: PackedMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import AuxRequest

    block_mask = meta.block_mask(window, q.device)
    heads_q = q.shape[1]
    gqa = heads_q & (heads_q - 1) == 0  # flex's GQA wants a power-of-two head count
    if not gqa:
        k, v = _repeat_kv(k, heads_q), _repeat_kv(v, heads_q)
    aux = AuxRequest(lse=True) if sinks is not None else None
    result = _flex_function(q.device)(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=aux
    )
    if sinks is None:
        return result.transpose(1, 2)
    out_BHTD, aux_out = result
    out_BHTD = out_BHTD * _sink_factor(aux_out.lse, sinks.view(1, -1, 1)).unsqueeze(
        -1
    ).to(out_BHTD.dtype)
    return out_BHTD.transpose(1, 2)


def _varlen_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    # [1, H, T, D] -> [T, H, D]
    return tuple(x[0].transpose(0, 1).contiguous() for x in (q, k, v))


def _torch_varlen(
    meta: PackedMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    if meta.prefix_of is not None:  # varlen_attn has no shared prefix: our kernel's (the same masking)
        return _triton(meta, q, k, v, scale, window, sinks, dropout)
    cu_seqlens, max_seqlen = meta.varlen(q.device)
    q_THD, k_THD, v_THD = _varlen_inputs(q, k, v)
    kwargs: dict[str, Any] = {
        "scale": scale,
        "window_size": (window - 1 if window else -1, 0),
    }
    if k_THD.shape[1] != q_THD.shape[1]:
        kwargs["enable_gqa"] = True
    if sinks is not None:
        kwargs["return_aux"] = AuxRequest(lse=True)
    out = varlen_attn(
        q_THD, k_THD, v_THD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs
    )
    if sinks is None:
        return out.unsqueeze(0)
    out_THD, lse_TH = out
    return (
        out_THD
        * _sink_factor(lse_TH, sinks.view(1, -1)).unsqueeze(-1).to(out_THD.dtype)
    ).unsqueeze(0)


def _triton(
    meta: PackedMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    from trainer.kernels.attention import flash_varlen_attention

    cu_seqlens, max_seqlen = meta.varlen(q.device)
    q_THD, k_THD, v_THD = _varlen_inputs(q, k, v)
    out_THD = flash_varlen_attention(
        q_THD,
        k_THD,
        v_THD,
        cu_seqlens,
        max_seqlen,
        causal=True,
        window=(window - 1, 0) if window else None,
        sinks=sinks,
        softmax_scale=scale,
        prefixes=meta.prefix_rows(q.device),
    )
    return out_THD.unsqueeze(0)


BACKEND_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": _sdpa,
    "flex": _flex,
    "torch_varlen": _torch_varlen,
    "triton": _triton,
}
"""Backend name (``trainer.data.packed_metadata.BACKENDS``) -> its attention call."""


def attend(
    meta: PackedMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention of one packed row through ``meta.backend``.

    Args:
        meta: the layer's view of the packed metadata (its ``backend`` picks the call).
        q: [1, Hq, T, D]; k, v: [1, Hkv, T, D].
        scale: softmax scale.
        window: tokens a query sees, itself included; None for full causal attention.
        sinks: GPT-OSS per-head sink logits [Hq], or None.
        dropout: attention dropout (sdpa only; the caller refuses it elsewhere).

    Returns:
        [1, T, Hq, D].
    """
    return BACKEND_FUNCTIONS[meta.backend](meta, q, k, v, scale, window, sinks, dropout)


def _sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink): the share the sink leaves to values."""
    return torch.sigmoid(lse.float() - sinks.float())


def _repeat_kv(x_BHTD: torch.Tensor, heads_q: int) -> torch.Tensor:
    n_rep = heads_q // x_BHTD.shape[1]
    return x_BHTD if n_rep == 1 else x_BHTD.repeat_interleave(n_rep, dim=1)


_FLEX_COMPILED: dict[str, Callable[..., Any]] = {}


def _flex_function(device: torch.device) -> Callable[..., Any]:
    """flex_attention, compiled on CUDA (eager flex materialises every score), eager on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _FLEX_COMPILED:
        _FLEX_COMPILED["cuda"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX_COMPILED["cuda"]
