"""Rotary position embedding (RoPE) for q and k in one Triton kernel, forward and backward.

transformers applies RoPE as ``q * cos + rotate_half(q) * sin`` (and the same for k): per
tensor a ``torch.cat`` copy, two multiplies and an add, each a full pass over ``[T, H, D]``,
again in the checkpoint recompute and again in backward. Here one kernel reads q (or k) once,
rotates in float32 and writes once; backward is the transposed rotation of the gradient
(``dx1 = g1 * cos + g2 * sin``, ``dx2 = g2 * cos - g1 * sin``). ``cos``/``sin`` are transformers'
``[B, T, D]`` tables (the two halves equal, as ``LlamaRotaryEmbedding`` builds them); only their
first half is read. Nothing is saved but the tables.

Layout: q/k as the attention modules hold them, ``[B, H, T, D]`` with any strides whose last
dim is contiguous (transformers' ``view(...).transpose(1, 2)``); outputs keep a dense input's
strides (``empty_like``), so downstream code sees what it would have seen, and are contiguous
for an overlapping input such as a gradient expanded along the batch.

Numerics: float32 inside, one rounding to the input dtype; transformers rounds each of the
three bf16 ops, so results differ by a bf16 ulp or so (tested against a float64 reference).
On CPU (or without triton) ``apply_rotary`` runs transformers' own formula.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional
    triton = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' formula: ``x * cos + rotate_half(x) * sin`` (cos/sin ``[B, T, D]``, x ``[B, H, T, D]``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


if triton is not None:

    @triton.jit
    def _rope_kernel(
        X, COS, SIN, OUT, T, H,
        stride_xb, stride_xh, stride_xt,
        stride_ob, stride_oh, stride_ot,
        stride_cb, stride_ct,
        HALF: tl.constexpr, BLOCK_T: tl.constexpr, BACKWARD: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, HALF)
        mask = rows[:, None] < T
        x_ptr = X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xt + cols[None, :]
        c_off = b * stride_cb + rows[:, None] * stride_ct + cols[None, :]
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(COS + c_off, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(SIN + c_off, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c + x2 * s
            y2 = x2 * c - x1 * s
        else:
            y1 = x1 * c - x2 * s
            y2 = x2 * c + x1 * s
        o_ptr = OUT + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + cols[None, :]
        tl.store(o_ptr, y1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_ptr + HALF, y2.to(OUT.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Same strides as a dense x (transformers' transposed view stays transposed); a contiguous
    # output for an overlapping one (an expanded gradient), which must not be written in place.
    out = torch.empty_like(x)
    B, H, T, D = x.shape
    block_t = 32
    grid = (triton.cdiv(T, block_t), B * H)
    _rope_kernel[grid](
        x, cos, sin, out, T, H,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0), cos.stride(1),
        HALF=D // 2, BLOCK_T=block_t, BACKWARD=backward,
    )
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, backward=True), None, None


def kernel_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the Triton kernel takes these inputs (else use ``reference_rotary``)."""
    if triton is None or x.device.type != "cuda" or x.dim() != 4 or cos.dim() != 3:
        return False
    d = x.shape[-1]
    half = d // 2
    return (
        d % 2 == 0
        and half & (half - 1) == 0  # power of two: tl.arange
        and half >= 16
        and cos.shape[-1] == d
        and cos.stride(-1) == 1
        and cos.shape[0] in (1, x.shape[0])
        and cos.shape[1] == x.shape[2]
        and cos.dtype == x.dtype
    )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[B, H, T, D]`` with ``cos``/``sin`` ``[B, T, D]``: the kernel on CUDA, else transformers' formula."""
    if not kernel_supported(x, cos) or sin.shape != cos.shape or sin.stride() != cos.stride():
        return reference_rotary(x, cos, sin)
    if cos.shape[0] != x.shape[0]:  # one table for the whole batch: broadcast by stride 0
        cos = cos.expand(x.shape[0], -1, -1)
        sin = sin.expand(x.shape[0], -1, -1)
    return _Rotary.apply(x, cos, sin)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb`` (``unsqueeze_dim=1`` layout only)."""
    if unsqueeze_dim != 1:
        cos_u, sin_u = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos_u + rotate_half(q) * sin_u, k * cos_u + rotate_half(k) * sin_u
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
