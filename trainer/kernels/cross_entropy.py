"""Cross-entropy over a chunk of logits rows, in place: the loss kernel's elementwise part in Triton.

Why: per chunk of the fused linear + cross-entropy (``trainer.features.loss.fused``) the torch path
upcasts the ``[C, V]`` logits to fp32, then runs log-sum-exp, a gather, ``exp``, a scatter, a
scale and a cast back, each a full pass over ``C x V`` fp32 (~2.4 GB of traffic per 512-token
chunk of Llama 3's 128k vocabulary, ~77 GB per 16k-token step). This kernel reads the bf16 logits
twice and writes the gradient once, in place over them (~0.4 GB per chunk): one program per row,

- pass 1: an online max and sum of ``exp`` over the row (``BLOCK`` columns at a time) give
  ``lse``; the row's loss is ``lse - logit[target]`` (0 for an ignored row), and whether the
  target is the row's argmax (token accuracy; the first column of a tied maximum, as
  ``torch.argmax`` picks);
- pass 2 (when a backward follows): ``grad = (exp(logit - lse) - onehot(target)) * scale`` in
  the logits' dtype, written over them; ``scale`` is ``1 / num_items`` (0 on ignored rows).

Gemma's final-logit soft-capping (``cap * tanh(logit / cap)``) is applied on the fly, its
derivative ``1 - tanh^2`` folded into the gradient. Numerics: as the torch path, every step in
fp32 from the logits as the matmul rounded them; the gradient rounded once to the logits' dtype.

Shapes (legend): ``C`` rows (tokens of a chunk), ``V`` the vocabulary.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU boxes have none; the loss then keeps its torch path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

BLOCK = 4096
"""Columns per iteration: 32 iterations per pass over a 128k vocabulary, 8 warps."""


def available(device: torch.device) -> bool:
    """Whether ``ce_rows_`` runs by default on ``device``: a CUDA device with Triton installed.
    (Tests also run it on the CPU under ``TRITON_INTERPRET=1`` by asking for it.)"""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _ce_rows_kernel(
        logits_ptr, stride_row, target_ptr, loss_ptr, hit_ptr, scale_ptr, scale_value,
        V, ignore_index, softcap,
        HAS_SOFTCAP: tl.constexpr, SCALE_IS_PTR: tl.constexpr, WRITE_GRAD: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride_row
        target = tl.load(target_ptr + row).to(tl.int64)
        valid = target != ignore_index
        safe_target = tl.where(valid, target, 0)
        m = tl.zeros([], dtype=tl.float32) - float("inf")
        d = tl.zeros([], dtype=tl.float32)
        best = tl.zeros([], dtype=tl.int64)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            if HAS_SOFTCAP:
                x = softcap * _tanh(x / softcap)
            block_max, block_at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            # strictly larger: the first column of the row's maximum wins, as torch.argmax picks
            best = tl.where(block_max > m, start + block_at.to(tl.int64), best)
            new_m = tl.maximum(m, block_max)
            d = d * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        lse = m + tl.log(d)
        x_t = tl.load(base + safe_target).to(tl.float32)
        if HAS_SOFTCAP:
            x_t = softcap * _tanh(x_t / softcap)
        tl.store(loss_ptr + row, tl.where(valid, lse - x_t, 0.0))
        tl.store(hit_ptr + row, tl.where(valid & (best == target), 1.0, 0.0))
        if WRITE_GRAD:
            if SCALE_IS_PTR:
                scale = tl.load(scale_ptr).to(tl.float32)
            else:
                scale = scale_value
            scale = tl.where(valid, scale, 0.0)
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < V
                raw = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    t = _tanh(raw / softcap)
                    x = softcap * t
                else:
                    x = raw
                g = tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                g = g * scale
                tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_rows_(
    logits_CV: torch.Tensor,
    target_C: torch.Tensor,
    scale: float | torch.Tensor,
    softcap: float | None,
    ignore_index: int,
    write_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and target-is-argmax flags (fp32 ``[C]`` each); with ``write_grad`` the
    gradient of ``sum(loss) * scale`` w.r.t. the logits overwrites ``logits_CV``.

    ``scale`` is a number or a device scalar (``1 / num_items``: a Python number costs no copy).
    """
    C, V = logits_CV.shape
    assert logits_CV.stride(1) == 1, f"logits rows must be contiguous, got strides {logits_CV.stride()}"
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    hit_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C == 0:
        return loss_C, hit_C
    scale_is_ptr = isinstance(scale, torch.Tensor)
    _ce_rows_kernel[(C,)](
        logits_CV, logits_CV.stride(0), target_C, loss_C, hit_C,
        scale if scale_is_ptr else loss_C, 0.0 if scale_is_ptr else float(scale),
        V, ignore_index, float(softcap) if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None, SCALE_IS_PTR=scale_is_ptr, WRITE_GRAD=write_grad,
        BLOCK_V=min(BLOCK, triton.next_power_of_2(V)), num_warps=8,
    )
    return loss_C, hit_C
