"""RMSNorm forward and backward in Triton, with the Hugging Face formulas as the torch path.

Why: HF's eager RMSNorm is seven memory-bound passes (fp32 upcast, ``pow``, ``mean``,
``rsqrt``, ``mul``, cast, ``mul`` by the weight), each again in backward, and autograd saves the
fp32 copies. On the Llama-3.1-8B LoRA step ``aten::mul`` was 12.5% and ``aten::add`` 7% of GPU
time, largely from here. The kernel reads ``x`` once and writes ``y`` once; it saves only ``x``
and one fp32 ``rstd`` per row for backward.

Variants (``Variant``), each reproducing one family's ``forward`` to the rounding step:

- ``LLAMA`` (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE):
  ``weight * (x * rstd).to(x.dtype)``: the normalised row is rounded to the input dtype BEFORE
  the weight multiplies it, and the result has ``torch.result_type`` of weight and input
  (bf16 for a bf16 model; fp32 when an fp32 weight meets a bf16 input).
- ``GPT_OSS`` (GPT-OSS, OLMo-2): ``(weight * (x * rstd)).to(x.dtype)``: product in fp32.
- ``GEMMA`` (Gemma 1-3): ``((x * rstd) * (1 + weight.float())).to(x.dtype)``.

Algorithm, rows of length ``H`` (``H <= MAX_H``), all arithmetic in fp32:

- forward: one program per ``ROWS`` rows; ``rstd = rsqrt(mean(x^2) + eps)``,
  ``y = (w + offset) * round?(x * rstd)``; stores ``y`` and ``rstd``.
- backward: ``g = dy * (w + offset)``, ``dx = rstd * (g - x_hat * mean(g * x_hat))`` (the rounding
  cast passes gradients through, as autograd's ``.to`` does). ``dweight``: each of a fixed number
  of programs sums ``dy * round?(x_hat)`` over its own contiguous chunk of rows into one fp32 row
  of a ``[programs, H]`` buffer, then ``torch.sum`` over programs: no atomics, so the same input
  gives the same bits every run. Skipped when the weight needs no grad (frozen under LoRA).

Numerics against eager: the same formula, but the kernel keeps ``dy * w`` in fp32 where eager
rounds it to the input dtype first, so gradients differ from eager by about one ulp of bf16.

Shapes (legend): ``N`` rows (all leading dims flattened), ``H`` the normalised size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton is optional: CPU boxes have none; ``supported`` reports it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

MAX_H = 8192
"""Longest row the kernel takes: one row lives in registers (8192 fp32 over 16 warps)."""
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = [
    "GEMMA",
    "GPT_OSS",
    "LLAMA",
    "MAX_H",
    "Variant",
    "can_use_kernel",
    "rms_norm_torch",
    "rms_norm_triton",
    "supported",
]


@dataclass(frozen=True)
class Variant:
    """Where one family's RMSNorm rounds and what it adds to the weight."""

    name: str
    offset: float
    """Added to the weight before it scales (Gemma's ``1 + w``), else 0."""
    cast_before_weight: bool
    """Llama-style: round ``x_hat`` to the input dtype, then multiply (result dtype promoted)."""

    def output_dtype(self, x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
        """The dtype eager code returns for input ``x_dtype`` and weight ``w_dtype``."""
        return (
            torch.promote_types(w_dtype, x_dtype)
            if self.cast_before_weight
            else x_dtype
        )


LLAMA = Variant("llama", 0.0, True)
GPT_OSS = Variant("gpt_oss", 0.0, False)
GEMMA = Variant("gemma", 1.0, False)


def supported(device: torch.device | str | None = None) -> str | None:
    """Why the elementwise kernels cannot run on ``device``, or None when they can.

    Args:
        device: the device the tensors live on; None means the current CUDA device.

    Returns:
        A one-line reason (no Triton, no CUDA, capability below 8.0) or None.
    """
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda", torch.cuda.current_device())
    )
    if dev.type != "cuda":
        return f"device {dev} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"CUDA capability {major}.{minor} is below 8.0 (Ampere): Triton's bf16 casts need it"
    return None


def can_use_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these tensors fit the kernel: float dtypes it handles, one matching ``H``, ``H <= MAX_H``."""
    return (
        triton is not None
        and x.dtype in SUPPORTED_DTYPES
        and weight.dtype in SUPPORTED_DTYPES
        and weight.dim() == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0]
        and 0 < weight.shape[0] <= MAX_H
        and x.device == weight.device
    )


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Variant
) -> torch.Tensor:
    """The family's eager ``forward``, op for op (so autograd and rounding match it bit for bit)."""
    if variant.cast_before_weight:  # LlamaRMSNorm.forward
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + eps)
        return weight * hidden.to(input_dtype)
    if variant.offset == 0.0:  # GptOssRMSNorm.forward
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + eps)
        return (weight * hidden).to(input_dtype)
    hidden = x.float()  # GemmaRMSNorm.forward
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    hidden = hidden * (variant.offset + weight.float())
    return hidden.type_as(x)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Variant
) -> torch.Tensor:
    """RMSNorm of the last dim through the Triton kernels; same result dtype as ``rms_norm_torch``.

    Args:
        x: ``[..., H]`` in bf16, fp16 or fp32.
        weight: ``[H]`` in bf16, fp16 or fp32 (``can_use_kernel`` checks both).
        eps: added to the mean square.
        variant: the family's rounding (``LLAMA``, ``GPT_OSS``, ``GEMMA``).

    Returns:
        ``[..., H]`` in ``variant.output_dtype(x.dtype, weight.dtype)``.
    """
    return _RMSNormFunction.apply(x, weight, float(eps), variant)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _fwd_kernel(
        X,
        W,
        Y,
        RSTD,
        n_rows,
        H,
        stride_x,
        stride_y,
        eps,
        offset,
        BLOCK_H: tl.constexpr,
        ROWS: tl.constexpr,
        CAST_BEFORE_WEIGHT: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        row_ok = rows < n_rows
        col_ok = cols < H
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(
            X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / H + eps)
        x_hat = x * rstd[:, None]
        if CAST_BEFORE_WEIGHT:
            x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
        y = x_hat * w[None, :]
        tl.store(
            Y + rows64[:, None] * stride_y + cols[None, :],
            y.to(Y.dtype.element_ty),
            mask=mask,
        )
        tl.store(RSTD + rows, rstd, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        DY,
        X,
        W,
        RSTD,
        DX,
        DW_PARTIAL,
        n_rows,
        H,
        stride_dy,
        stride_x,
        stride_dx,
        offset,
        blocks_per_program,
        BLOCK_H: tl.constexpr,
        ROWS: tl.constexpr,
        CAST_BEFORE_WEIGHT: tl.constexpr,
        COMPUTE_DW: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < H
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
        dw = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        for i in range(blocks_per_program):
            rows = (pid * blocks_per_program + i) * ROWS + tl.arange(0, ROWS)
            row_ok = rows < n_rows
            mask = row_ok[:, None] & col_ok[None, :]
            rows64 = rows.to(tl.int64)
            x = tl.load(
                X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            dy = tl.load(
                DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            x_hat = x * rstd[:, None]
            if COMPUTE_DW:
                if CAST_BEFORE_WEIGHT:
                    dw += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
                else:
                    dw += dy * x_hat
            g = dy * w[None, :]
            c = tl.sum(g * x_hat, 1) / H
            dx = rstd[:, None] * (g - x_hat * c[:, None])
            tl.store(
                DX + rows64[:, None] * stride_dx + cols[None, :],
                dx.to(DX.dtype.element_ty),
                mask=mask,
            )
        if COMPUTE_DW:
            tl.store(
                DW_PARTIAL + pid.to(tl.int64) * H + cols, tl.sum(dw, 0), mask=col_ok
            )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

_TILE_ELEMENTS = 2048
"""Rows per program = this / BLOCK_H (at least 1): head-dim norms (H=128) take 16 rows a program."""
_BWD_PROGRAMS_PER_SM = 4
"""Backward programs per SM: each loops over its chunk of rows and writes one dweight row."""
_BWD_PROGRAMS_OFF_CUDA = 3
"""Backward programs where there are no SMs to count (the interpreter): several, so chunks split."""


def _tile(H: int) -> tuple[int, int, int]:
    """``(BLOCK_H, ROWS, num_warps)``; warps follow Liger's ``calculate_settings`` (not swept here)."""
    block_h = triton.next_power_of_2(H)
    rows = max(1, _TILE_ELEMENTS // block_h)
    elements = block_h * rows
    num_warps = 4 if elements < 2048 else 8 if elements < 8192 else 16
    return block_h, rows, num_warps


def _bwd_programs(device: torch.device, n_blocks: int) -> int:
    if device.type == "cuda":
        target = (
            _BWD_PROGRAMS_PER_SM
            * torch.cuda.get_device_properties(device).multi_processor_count
        )
    else:
        target = _BWD_PROGRAMS_OFF_CUDA
    return max(1, min(n_blocks, target))


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """``t`` as ``[N, H]`` with unit stride along ``H`` (a view when the layout allows)."""
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Variant):
    H = weight.shape[0]
    x2 = _rows(x, H)
    n_rows = x2.shape[0]
    y = torch.empty(
        (n_rows, H), device=x.device, dtype=variant.output_dtype(x.dtype, weight.dtype)
    )
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    if n_rows:
        block_h, rows, warps = _tile(H)
        _fwd_kernel[(triton.cdiv(n_rows, rows),)](
            x2,
            weight,
            y,
            rstd,
            n_rows,
            H,
            x2.stride(0),
            y.stride(0),
            eps,
            variant.offset,
            BLOCK_H=block_h,
            ROWS=rows,
            CAST_BEFORE_WEIGHT=variant.cast_before_weight,
            num_warps=warps,
        )
    return y.view(*x.shape[:-1], H), x2, rstd


def _backward(dy, x2, weight, rstd, variant: Variant, compute_dw: bool):
    n_rows, H = x2.shape
    dy2 = _rows(dy, H)
    dx = torch.empty_like(x2)
    block_h, rows, warps = _tile(H)
    n_blocks = triton.cdiv(n_rows, rows)
    programs = _bwd_programs(x2.device, n_blocks)
    blocks_per_program = triton.cdiv(n_blocks, programs) if n_blocks else 0
    programs = triton.cdiv(n_blocks, blocks_per_program) if n_blocks else 0
    partial = torch.zeros(
        (max(programs, 1) if compute_dw else 1, H),
        device=x2.device,
        dtype=torch.float32,
    )
    if programs:
        _bwd_kernel[(programs,)](
            dy2,
            x2,
            weight,
            rstd,
            dx,
            partial,
            n_rows,
            H,
            dy2.stride(0),
            x2.stride(0),
            dx.stride(0),
            variant.offset,
            blocks_per_program,
            BLOCK_H=block_h,
            ROWS=rows,
            CAST_BEFORE_WEIGHT=variant.cast_before_weight,
            COMPUTE_DW=compute_dw,
            num_warps=warps,
        )
    dw = partial.sum(0).to(weight.dtype) if compute_dw else None
    return dx, dw


class _RMSNormFunction(torch.autograd.Function):
    """Autograd over the kernels: saves ``x`` (as ``[N, H]``) and ``rstd`` only."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Variant
    ) -> torch.Tensor:
        y, x2, rstd = _forward(x, weight, eps, variant)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.variant, ctx.x_shape = variant, x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(
            dy, x2, weight, rstd, ctx.variant, compute_dw=ctx.needs_input_grad[1]
        )
        dx = dx.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, dw, None, None
