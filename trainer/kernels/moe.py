"""Triton kernels of the grouped MoE path (trainer/features/moe/routing.py): the gate activation, the combine, their backward.

Kernel, launcher and ``autograd.Function`` live here (Liger ``ops/swiglu.py`` shape); the experts
forward that picks them is ``trainer.features.moe.routing.grouped_experts_forward``. Each kernel computes in
fp32 and reads its rows once. ``dispatch`` and ``combine`` keep the torch-ops path next to the
kernels (``use_triton=False``): the reference the kernels are tested against, in Triton's
interpreter on CPU (``tests/unit/trainer/features/moe/test_moe_routing.py``).

The launchers take the layer's ``RoutingMetadata`` (``inverse_S``, ``token_S``, ``sort_idx_S``,
``slot_expert_S``, ``num_tokens``, ``top_k``); shape legend as in ``trainer.features.moe.routing``: T tokens,
K experts per token, S = T*K routed slots, E experts, H hidden size, I expert intermediate size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

try:  # Triton is optional (CPU boxes may lack it): only the gate and combine kernels need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

if TYPE_CHECKING:
    from trainer.features.moe.metadata import RoutingMetadata

__all__ = [
    "ACT_GPT_OSS", "ACT_SILU", "combine", "dispatch", "fused_gate", "gather_sum", "has_triton", "scale_rows",
    "slot_dots", "triton_runs",
]

ACT_GPT_OSS = 0
"""GPT-OSS: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``; gate/up interleaved."""
ACT_SILU = 1
"""Qwen3-MoE / Mixtral: ``silu(gate) * up``; gate and up concatenated (``chunk(2)``)."""


def has_triton() -> bool:
    """True when Triton is installed."""
    return triton is not None


def triton_runs(device: torch.device) -> bool:
    """True when the kernels can run on ``device``: CUDA, or any device under Triton's interpreter."""
    return triton is not None and (device.type == "cuda" or interpreting())


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (tests run the kernels on CPU tensors then)."""
    if triton is None:
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


# --- The fused gate: one Triton kernel forward, one backward -------------------------------------
#
# Why: between the two grouped GEMMs, the gate is ~10 element-wise torch ops over [S, 2I] / [S, I]
# (bias gather + add, strided gate/up views, two clamps, sigmoid, three multiplies, an add), each
# a full pass over memory that autograd also keeps alive for backward. On a GPT-OSS-20B layer with
# 16k tokens (S = 65,536 rows, I = 2,880) each such tensor is 0.38-0.75 GB. The kernel reads the
# GEMM output (and the bias row of the row's expert) once, computes in fp32, writes [S, I] once;
# backward recomputes the activation from the saved GEMM output instead of keeping intermediates.

if triton is not None:

    @triton.jit
    def _cols(I, INTERLEAVED: tl.constexpr, BLOCK: tl.constexpr):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if INTERLEAVED:  # GPT-OSS: gate, up, gate, up, ...
            g_col = 2 * cols
            u_col = 2 * cols + 1
        else:  # chunk(2): all gates, then all ups
            g_col = cols
            u_col = cols + I
        return cols, g_col, u_col

    @triton.jit
    def _load_gate_up(h_ptr, expert_ptr, bias_ptr, row, g_col, u_col, mask, I, HAS_BIAS: tl.constexpr):
        g = tl.load(h_ptr + row * 2 * I + g_col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * 2 * I + u_col, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(expert_ptr + row).to(tl.int64)
            g += tl.load(bias_ptr + e * 2 * I + g_col, mask=mask, other=0.0).to(tl.float32)
            u += tl.load(bias_ptr + e * 2 * I + u_col, mask=mask, other=0.0).to(tl.float32)
        return g, u

    @triton.jit
    def gate_fwd(h_ptr, expert_ptr, bias_ptr, out_ptr, I, limit, alpha,
                 INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols, g_col, u_col = _cols(I, INTERLEAVED, BLOCK)
        mask = cols < I
        g, u = _load_gate_up(h_ptr, expert_ptr, bias_ptr, row, g_col, u_col, mask, I, HAS_BIAS)
        if ACT == 0:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            out = (u + 1.0) * (g * tl.sigmoid(g * alpha))
        else:
            out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + row * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gate_bwd(h_ptr, expert_ptr, bias_ptr, dout_ptr, dh_ptr, I, limit, alpha,
                 INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols, g_col, u_col = _cols(I, INTERLEAVED, BLOCK)
        mask = cols < I
        g, u = _load_gate_up(h_ptr, expert_ptr, bias_ptr, row, g_col, u_col, mask, I, HAS_BIAS)
        d = tl.load(dout_ptr + row * I + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            # torch.clamp passes the gradient where min <= x <= max (inclusive): same masks here.
            gc = tl.minimum(g, limit)
            sig = tl.sigmoid(gc * alpha)
            uc = tl.minimum(tl.maximum(u, -limit), limit)
            du = tl.where((u >= -limit) & (u <= limit), d * gc * sig, 0.0)
            dg = tl.where(g <= limit, d * (uc + 1.0) * (sig + alpha * gc * sig * (1.0 - sig)), 0.0)
        else:
            sig = tl.sigmoid(g)
            du = d * g * sig
            dg = d * u * (sig + g * sig * (1.0 - sig))
        ty = dh_ptr.dtype.element_ty
        tl.store(dh_ptr + row * 2 * I + g_col, dg.to(ty), mask=mask)
        tl.store(dh_ptr + row * 2 * I + u_col, du.to(ty), mask=mask)


_GATE_BLOCK = 1024
"""Columns per program: the intermediate sizes we meet (768 - 2,880) take 1-3 programs per row."""


class _FusedGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_SN, expert_S, bias_EN, act, interleaved, limit, alpha):
        h_SN = h_SN.contiguous()
        S, N = h_SN.shape
        out_SI = h_SN.new_empty(S, N // 2)
        ctx.save_for_backward(h_SN, expert_S, bias_EN)
        ctx.params = (act, interleaved, limit, alpha)
        if S:
            grid = (S, -(-(N // 2) // _GATE_BLOCK))
            gate_fwd[grid](h_SN, expert_S, bias_EN if bias_EN is not None else h_SN, out_SI, N // 2, limit, alpha,
                      INTERLEAVED=interleaved, HAS_BIAS=bias_EN is not None, ACT=act, BLOCK=_GATE_BLOCK)
        return out_SI

    @staticmethod
    def backward(ctx, grad_SI):
        h_SN, expert_S, bias_EN = ctx.saved_tensors
        act, interleaved, limit, alpha = ctx.params
        S, N = h_SN.shape
        grad_h = torch.empty_like(h_SN)
        if S:
            grid = (S, -(-(N // 2) // _GATE_BLOCK))
            gate_bwd[grid](h_SN, expert_S, bias_EN if bias_EN is not None else h_SN, grad_SI.contiguous(), grad_h,
                      N // 2, limit, alpha,
                      INTERLEAVED=interleaved, HAS_BIAS=bias_EN is not None, ACT=act, BLOCK=_GATE_BLOCK)
        grad_bias = None
        if bias_EN is not None and ctx.needs_input_grad[2]:
            # What autograd does for bias.index_select(0, expert_S): scatter-add the rows back.
            grad_bias = torch.zeros_like(bias_EN).index_add_(0, expert_S, grad_h.to(bias_EN.dtype))
        return grad_h if ctx.needs_input_grad[0] else None, None, grad_bias, None, None, None, None


def fused_gate(
    h_SN: torch.Tensor,
    expert_S: torch.Tensor,
    bias_EN: torch.Tensor | None,
    act: int,
    interleaved: bool,
    limit: float = 0.0,
    alpha: float = 1.0,
) -> torch.Tensor:
    """Gate activation of the grouped gate/up GEMM output in one Triton kernel (fp32 inside).

    Args:
        h_SN: ``[S, 2I]`` gate/up projections in grouped order (before bias).
        expert_S: ``[S]`` expert of each row, to pick its bias row.
        bias_EN: ``[E, 2I]`` gate/up bias, or None.
        act: ``ACT_GPT_OSS`` or ``ACT_SILU``.
        interleaved: gate and up alternate along the last dim (GPT-OSS) instead of being two halves.
        limit, alpha: GPT-OSS's clamp limit and sigmoid scale.
    Returns:
        ``[S, I]`` in ``h_SN``'s dtype.
    """
    return _FusedGate.apply(h_SN, expert_S, bias_EN, act, interleaved, float(limit), float(alpha))


# --- Routing kernels: combine, its backward, the dispatch's backward -------------------------------
#
# Why: in torch ops the combine is a gather of [S, H] into token order, a bias gather + add, then a
# bmm with K = 4 (a batched GEMM of 16k 1x4 by 4x2880 products); its backward and the dispatch's
# backward are gathers that materialise another [S, H] each before reducing. These kernels read
# each [S, H] row where it lies (rows addressed through ``inverse_S`` / ``token_S``), accumulate
# in fp32 and write the result once: out[t] = sum_j w[t, j] * (src[inverse[t*K + j]] + b[e_tj]).

_ROW_BLOCK = 1024
"""Columns per program for the row kernels (hidden sizes 2,048 - 7,168: 2-7 programs per row)."""

if triton is not None:

    @triton.jit
    def gather_sum_kernel(src_ptr, inverse_ptr, w_ptr, bias_ptr, slot_expert_ptr, out_ptr, H,
                          K: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            v = tl.load(src_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                e = tl.load(slot_expert_ptr + t * K + j).to(tl.int64)
                v += tl.load(bias_ptr + e * H + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v *= tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def scale_rows_kernel(grad_ptr, token_ptr, sort_idx_ptr, w_ptr, out_ptr, H, BLOCK: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        t = tl.load(token_ptr + s).to(tl.int64)
        w = tl.load(w_ptr + tl.load(sort_idx_ptr + s)).to(tl.float32)
        g = tl.load(grad_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + s * H + cols, (g * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def slot_dots_kernel(grad_ptr, src_ptr, inverse_ptr, bias_ptr, slot_expert_ptr, out_ptr, H,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, H_BLOCKS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        for j in tl.static_range(K):
            row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
            if HAS_BIAS:
                e = tl.load(slot_expert_ptr + t * K + j).to(tl.int64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(H_BLOCKS):  # a constexpr trip count (Triton's interpreter cannot range over an argument)
                cols = i * BLOCK + tl.arange(0, BLOCK)
                mask = cols < H
                g = tl.load(grad_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(src_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    v += tl.load(bias_ptr + e * H + cols, mask=mask, other=0.0).to(tl.float32)
                acc += g * v
            tl.store(out_ptr + t * K + j, tl.sum(acc, axis=0))


def gather_sum(src_SH: torch.Tensor, meta: RoutingMetadata, weights_TK: torch.Tensor | None,
                bias_EH: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * (src[inverse[t*K + j]] + bias[e_tj])`` (w = 1 without weights)."""
    src_SH = src_SH.contiguous()
    H = src_SH.shape[1]
    out_TH = src_SH.new_empty(meta.num_tokens, H)
    weights = weights_TK.contiguous() if weights_TK is not None else src_SH
    bias = bias_EH.contiguous() if bias_EH is not None else src_SH
    grid = (meta.num_tokens, -(-H // _ROW_BLOCK))
    gather_sum_kernel[grid](src_SH, meta.inverse_S, weights, bias, meta.slot_expert_S, out_TH, H,
                            K=meta.top_k, HAS_W=weights_TK is not None, HAS_BIAS=bias_EH is not None,
                            BLOCK=_ROW_BLOCK)
    return out_TH


def scale_rows(grad_TH: torch.Tensor, meta: RoutingMetadata, weights_TK: torch.Tensor) -> torch.Tensor:
    """``out[s] = w.flat[sort_idx[s]] * grad[token[s]]``: the combine's gradient in grouped order."""
    grad_TH = grad_TH.contiguous()
    H = grad_TH.shape[1]
    out_SH = grad_TH.new_empty(meta.num_slots, H)
    grid = (meta.num_slots, -(-H // _ROW_BLOCK))
    scale_rows_kernel[grid](grad_TH, meta.token_S, meta.sort_idx_S, weights_TK.contiguous(), out_SH, H,
                            BLOCK=_ROW_BLOCK)
    return out_SH


def slot_dots(grad_TH: torch.Tensor, src_SH: torch.Tensor, meta: RoutingMetadata,
               bias_EH: torch.Tensor | None) -> torch.Tensor:
    """``out[t, j] = <grad[t], src[inverse[t*K + j]] + bias[e_tj]>`` in fp32: the routing weights' gradient."""
    grad_TH, src_SH = grad_TH.contiguous(), src_SH.contiguous()
    H = grad_TH.shape[1]
    out_TK = torch.empty(meta.num_tokens, meta.top_k, device=grad_TH.device, dtype=torch.float32)
    bias = bias_EH.contiguous() if bias_EH is not None else src_SH
    slot_dots_kernel[(meta.num_tokens,)](grad_TH, src_SH, meta.inverse_S, bias, meta.slot_expert_S, out_TK, H,
                                         K=meta.top_k, HAS_BIAS=bias_EH is not None, BLOCK=_ROW_BLOCK,
                                         H_BLOCKS=-(-H // _ROW_BLOCK))
    return out_TK


# --- Dispatch and combine: torch ops or the row kernels above --------------------------------------


class _Dispatch(torch.autograd.Function):
    """``x_TH[token_S]``: token rows copied into grouped order; backward = one gather + sum over K."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, meta: RoutingMetadata, use_triton: bool) -> torch.Tensor:
        ctx.meta, ctx.use_triton = meta, use_triton
        return x_TH.index_select(0, meta.token_S)

    @staticmethod
    def backward(ctx, grad_SH: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        meta = ctx.meta
        if ctx.use_triton:
            return gather_sum(grad_SH, meta, None, None), None, None
        # Row s of the grouped order came from token sort_idx_S[s] // K; reading the grouped
        # gradient back in flat slot order puts a token's K rows next to each other.
        grad_TKH = grad_SH.index_select(0, meta.inverse_S).view(meta.num_tokens, meta.top_k, -1)
        return grad_TKH.sum(dim=1, dtype=torch.float32).to(grad_SH.dtype), None, None


class _Combine(torch.autograd.Function):
    """``out[t] = sum_j w[t, j] * (y[inverse[t*K + j]] + b[e_tj])``: the weighted scatter-add back to token order.

    Written as a gather by the inverse permutation, never an atomic scatter: deterministic, fp32
    accumulation. Torch ops: ``index_select`` + one ``bmm`` (the bias must be added to ``y``
    before; ``bias_EH`` only with Triton). Triton: one kernel reads each expert-output row once
    and adds the bias row of its expert on the fly. Backward: ``dy`` is a gather of the output
    gradient scaled by the slot's weight; ``dw`` a dot product per slot.
    """

    @staticmethod
    def forward(ctx, y_SH, weights_TK, bias_EH, meta: RoutingMetadata, use_triton: bool) -> torch.Tensor:
        ctx.meta, ctx.use_triton = meta, use_triton
        ctx.save_for_backward(y_SH, weights_TK, bias_EH)
        if use_triton:
            return gather_sum(y_SH, meta, weights_TK, bias_EH)
        assert bias_EH is None, "the torch-ops combine takes the bias already added to y"
        T, K = meta.num_tokens, meta.top_k
        y_TKH = y_SH.index_select(0, meta.inverse_S).view(T, K, -1)
        return torch.bmm(weights_TK.to(y_SH.dtype).view(T, 1, K), y_TKH).view(T, -1)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):
        meta = ctx.meta
        y_SH, weights_TK, bias_EH = ctx.saved_tensors
        T, K = meta.num_tokens, meta.top_k
        need_y, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_w = grad_b = None
        if need_y or need_b:
            if ctx.use_triton:
                grad_y = scale_rows(grad_TH, meta, weights_TK)
            else:
                # Row s of the grouped order is flat slot sort_idx_S[s]: weight w.flat[slot], token slot // K.
                w_S = weights_TK.reshape(-1).index_select(0, meta.sort_idx_S).to(grad_TH.dtype)
                grad_y = grad_TH.index_select(0, meta.token_S) * w_S[:, None]
        if need_w:
            if ctx.use_triton:
                grad_w = slot_dots(grad_TH, y_SH, meta, bias_EH).to(weights_TK.dtype)
            else:
                y_TKH = y_SH.index_select(0, meta.inverse_S).view(T, K, -1)
                grad_w = torch.bmm(y_TKH, grad_TH.view(T, -1, 1)).view(T, K).to(weights_TK.dtype)
        if need_b:
            # What autograd does for bias.index_select(0, expert_S): scatter-add the rows back.
            grad_b = torch.zeros_like(bias_EH).index_add_(0, meta.expert_S, grad_y.to(bias_EH.dtype))
        return grad_y if need_y else None, grad_w, grad_b, None, None


def dispatch(x_TH: torch.Tensor, meta: RoutingMetadata, use_triton: bool) -> torch.Tensor:
    """``[T, H] -> [S, H]``: token rows in expert-grouped order (``x_TH[meta.token_S]``), backward by one gather.

    Args:
        x_TH: the layer's hidden states.
        meta: the layer's routing.
        use_triton: run the backward as ``gather_sum`` (else torch ops: the reference).
    """
    return _Dispatch.apply(x_TH, meta, use_triton)


def combine(
    y_SH: torch.Tensor,
    weights_TK: torch.Tensor,
    bias_EH: torch.Tensor | None,
    meta: RoutingMetadata,
    use_triton: bool,
) -> torch.Tensor:
    """``[S, H] -> [T, H]``: ``out[t] = sum_j w[t, j] * (y[inverse[t*K + j]] + b[e_tj])`` (``_Combine``).

    Args:
        y_SH: expert outputs in grouped order.
        weights_TK: routing weights.
        bias_EH: per-expert output bias, only with ``use_triton`` (torch ops take it added to ``y_SH``).
        meta: the layer's routing.
        use_triton: the row kernels (else torch ops: the reference).
    """
    return _Combine.apply(y_SH, weights_TK, bias_EH, meta, use_triton)
