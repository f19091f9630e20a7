"""``silu(gate) * up`` forward and backward in Triton, with the eager expression as the torch path.

Why: the Llama-form MLP computes ``act_fn(gate_proj(x)) * up_proj(x)`` as two kernels in
forward (``silu``, ``mul``) and three in backward (two ``mul``, ``silu_backward``), and autograd
keeps ``silu(gate)`` alive as well as ``gate`` and ``up``: at 16k tokens and a 14336-wide MLP
that is one more 470 MB bf16 tensor per layer. Here one kernel each way; only ``gate`` and
``up`` are saved, ``silu`` is recomputed in backward.

The kernels round where eager rounds, so in bf16 they give eager's bits up to the last ulp of
``exp``: forward ``s = silu(g)`` rounded to the input dtype, then ``y = s * u`` rounded;
backward ``ds = dy * u`` rounded, ``du = dy * s`` rounded,
``dg = ds * sig * (1 + g * (1 - sig))`` with ``sig = 1 / (1 + exp(-g))``, all arithmetic in fp32.
``silu(g)`` is computed as ``g / (1 + exp(-g))``, torch's own formula.

Shapes: ``gate`` and ``up`` of one shape ``[..., I]`` and one dtype; the kernel treats them as
flat arrays of ``numel`` elements, or (forward, when either is a column block of a wider matrix)
as rows of ``I`` some stride apart, read in place; the output is contiguous.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainer.kernels.rmsnorm import SUPPORTED_DTYPES, supported

try:  # Triton is optional: CPU boxes have none; ``supported`` reports it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

__all__ = ["can_use_kernel", "supported", "swiglu_torch", "swiglu_triton"]

_BLOCK = 1024
"""Elements per program (a common choice for a streaming elementwise kernel; not swept here)."""
_NUM_WARPS = 4


def can_use_kernel(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes this pair: one shape, one supported dtype, one device."""
    return (
        triton is not None
        and gate.dtype in SUPPORTED_DTYPES
        and gate.dtype == up.dtype
        and gate.shape == up.shape
        and gate.device == up.device
    )


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up``: exactly what the Llama MLP computes with ``act_fn`` = SiLU."""
    return F.silu(gate) * up


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` through the Triton kernels.

    Args:
        gate: ``[..., I]`` in bf16, fp16 or fp32 (under autocast: the bf16 ``gate_proj`` output).
        up: same shape and dtype as ``gate``.

    Returns:
        ``[..., I]`` in the inputs' dtype.
    """
    return _SwiGLUFunction.apply(gate, up)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + offs, (s * u).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _fwd_rows_kernel(G, U, Y, cols, stride_g, stride_u, BLOCK: tl.constexpr):
        """The forward over rows ``stride_*`` apart (column blocks of a wider matrix); Y contiguous."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < cols
        g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * cols + offs, (s * u).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        s = (g / (1.0 + tl.exp(-g))).to(DU.dtype.element_ty).to(tl.float32)
        ds = (dy * u).to(DG.dtype.element_ty).to(tl.float32)
        dg = ds * sig * (1.0 + g * (1.0 - sig))
        tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=ok)
        tl.store(DU + offs, (dy * s).to(DU.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` ``[..., I]`` as a ``[rows, I]`` view with contiguous columns (a served model's gate and up
    are column blocks of one matmul's output, ``trainer.features.lora_kernel.siblings``), else None."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


class _SwiGLUFunction(torch.autograd.Function):
    """Autograd over the kernels: saves ``gate`` and ``up``, recomputes ``silu`` in backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate.numel()
        ctx.save_for_backward(gate, up)
        if not n:
            return y
        cols = gate.shape[-1]
        g2, u2 = _rows(gate), _rows(up)
        if g2 is not None and u2 is not None and not (g2.is_contiguous() and u2.is_contiguous()):
            _fwd_rows_kernel[(g2.shape[0], triton.cdiv(cols, _BLOCK))](
                g2, u2, y, cols, g2.stride(0), u2.stride(0), BLOCK=_BLOCK, num_warps=_NUM_WARPS
            )
            return y
        gate_c, up_c = gate.contiguous(), up.contiguous()
        _fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate_c, up_c, y, n, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        gate, up = (t.contiguous() for t in ctx.saved_tensors)
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _bwd_kernel[(triton.cdiv(n, _BLOCK),)](
                dy, gate, up, dgate, dup, n, BLOCK=_BLOCK, num_warps=_NUM_WARPS
            )
        return dgate, dup
