"""Float64 per-sample attention: the ground truth for the varlen kernel's tests and benchmarks.

Same signature and masking rules as ``flash_varlen_attention`` (flash-attn's
``window_size=(left, right)`` within each sample, ``causal`` forcing ``right = 0``, GPT-OSS
sinks as one extra logit per head with no value). It loops over samples on the host, so it
reads ``cu_seqlens`` back (a sync): fine for a reference, never for the training step.
Differentiable, so ``torch.autograd`` on float64 leaves gives the reference gradients.
"""

from __future__ import annotations

import math

import torch

__all__ = ["reference_varlen_attention"]


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    sinks: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    prefixes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each packed sample, computed in float64.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] with ``Hq % Hkv == 0``.
        cu_seqlens: [N + 1] offsets from 0 to T.
        max_seqlen: the longest sample (checked against ``cu_seqlens``).
        causal, window, sinks, softmax_scale, prefixes: as in ``flash_varlen_attention`` (a sample's
            queries also see every key of its prefix rows).

    Returns:
        [T, Hq, D] float64 output.
    """
    offsets = [int(x) for x in cu_seqlens.tolist()]
    T, Hq, D = q.shape
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}; got {offsets}")
    longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest sample ({longest})")
    group = Hq // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    spans = [(0, 0)] * (len(offsets) - 1) if prefixes is None else [(int(r[0]), int(r[1])) for r in prefixes.tolist()]
    outs = []
    for (a, b), (p_start, p_len) in zip(zip(offsets, offsets[1:]), spans):
        rows = list(range(p_start, p_start + p_len)) + list(range(a, b))  # the prefix's keys, then the sample's
        qs = q[a:b].double().transpose(0, 1)  # [Hq, L, D]
        ks = k[rows].double().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[rows].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale  # [Hq, L, P + L]
        scores = scores.masked_fill(~_allowed(b - a, p_len, left, right, q.device), float("-inf"))
        if sinks is not None:
            sink_col = sinks.double()[:, None, None].expand(Hq, b - a, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append((probs @ vs).transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape, dtype=torch.float64)
    return torch.cat(outs, dim=0)


def _allowed(length: int, prefix: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """[L, P + L] bool: every key of the ``prefix``, then the sample's own keys within the window."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    own = torch.ones(length, length, dtype=torch.bool, device=device)
    if right >= 0:
        own &= j <= i + right
    if left >= 0:
        own &= j >= i - left
    return torch.cat([torch.ones(length, prefix, dtype=torch.bool, device=device), own], dim=1)
