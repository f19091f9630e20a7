"""Varlen flash attention in Triton: packed rows, ``cu_seqlens``, no cross-sample block.

Why: stock transformers packs samples by building one dense ``T x T`` mask and SDPA then
computes every block of it; with 16k tokens of ~250-token samples only ~3% of the scores lie
inside a sample. This kernel maps program ids to ``(sample, block)`` pairs, so a block that
would cross a sample boundary is never computed, and a causal block above the diagonal is
never visited.

Algorithm (FlashAttention-2):
- forward: one program per (query block, query head, sample); it returns at once when the
  block starts past the sample's length (the grid is ``cdiv(max_seqlen, BLOCK_M) x Hq x N``
  with ``max_seqlen`` a Python int, so no host sync). Online softmax over the key blocks the
  mask allows; stores the log-sum-exp ``LSE`` per row (fp32).
- attention sinks (GPT-OSS): one extra logit per head in the softmax denominator with no
  value, so ``out = out_nosink * sigmoid(lse - sink)``; ``LSE`` stored includes the sink.
- backward: a preprocessing kernel computes ``delta_i = dO_i . O_i`` (and each row's share of
  the sink gradient, ``-exp(sink - lse_i) * delta_i``); one kernel computes dK/dV per key
  block, looping over the query heads of its GQA group and over query blocks, so no atomics;
  one kernel computes dQ per query block. P is recomputed from ``LSE`` in both.

Shapes (legend): ``T`` packed tokens, ``N`` samples, ``Hq``/``Hkv`` query/key-value heads
(``Hq % Hkv == 0``), ``D`` head dim (64 or 128). ``q_THD``: [T, Hq, D];
``k_THD``/``v_THD``: [T, Hkv, D]; ``cu_seqlens_N1``: int32 [N + 1], on the device, with
``cu_seqlens[0] == 0`` and ``cu_seqlens[-1] == T`` (this cannot be checked without a host
sync, so it is the caller's contract; rows past ``cu_seqlens[-1]`` are left unwritten).

Shared prefixes (``prefixes``, GRPO's prompt trained once for its group): a sample may also see
every key of an earlier sample, its prefix; the forward and dQ kernels run the online softmax over
the prefix's keys before the sample's own, and the dK/dV kernel of a prefix's key block loops on
over the query rows of the samples that share it (they follow it, contiguous, up to its "query
end"), so the prefix's key gradients sum over all of them without atomics.

Masking follows flash-attn's ``window_size=(left, right)``, positions local to each sample:
query ``i`` sees key ``j`` when ``i - left <= j <= i + right`` (``-1`` = unbounded side);
``causal=True`` forces ``right = 0``.

Kernels, launchers and the ``autograd.Function`` live in this one module; the float64
per-sample reference that tests and benchmarks compare against is ``reference.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

try:  # Triton is optional: CPU boxes have none; ``supported`` reports it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = ["SUPPORTED_HEAD_DIMS", "flash_varlen_attention", "supported"]


def supported(device: torch.device | str | None = None, head_dim: int | None = None) -> str | None:
    """Why this kernel cannot run on ``device`` (and ``head_dim``), or None when it can.

    Args:
        device: the device the tensors live on; None means the current CUDA device.
        head_dim: the attention head dimension, if known.

    Returns:
        A one-line reason (no CUDA, no Triton, capability below 8.0, head dim) or None.
    """
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head dim {head_dim} is not supported (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return f"device {dev} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"CUDA capability {major}.{minor} is below 8.0 (Ampere); the kernel needs bf16 tensor cores"
    return None


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _window_mask(offs_m, offs_n, seqlen, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """[BM, BN] mask: both rows inside the sample and key j within query i's window."""
        mask = (offs_m[:, None] < seqlen) & (offs_n[None, :] < seqlen)
        if HAS_RIGHT:
            mask = mask & (offs_n[None, :] <= offs_m[:, None] + right)
        if HAS_LEFT:
            mask = mask & (offs_n[None, :] >= offs_m[:, None] - left)
        return mask

    @triton.jit
    def _key_range(m0, seqlen, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Key blocks [lo, hi) that query block [m0, m0 + BLOCK_M) can see."""
        hi = seqlen
        if HAS_RIGHT:
            hi = tl.minimum(seqlen, m0 + BLOCK_M + right)
        lo = 0
        if HAS_LEFT:
            lo = tl.maximum(0, m0 - left)
            lo = (lo // BLOCK_N) * BLOCK_N
        return lo, hi

    @triton.jit
    def _online_block(q, K, V, rows_n, kv_mask, allowed, hk, qk_scale, m_i, l_i, acc,
                      stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr):
        """One key block of the online softmax: (m, l, acc) updated with keys ``rows_n`` where ``allowed``."""
        offs_d = tl.arange(0, HEAD_DIM)
        k = tl.load(K + rows_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + rows_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _fwd_kernel(
        Q, K, V, O, LSE, SINK, CU, PFX, softmax_scale, left, right,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_lh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        hq = tl.program_id(1)
        seq = tl.program_id(2)
        start = tl.load(CU + seq)
        seqlen = tl.load(CU + seq + 1) - start
        m0 = pid_m * BLOCK_M
        if m0 >= seqlen:
            return  # this block lies past the sample: nothing to load, nothing to write
        hk = hq // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        rows_m = (start + offs_m).to(tl.int64)
        q = tl.load(Q + rows_m[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
                    mask=offs_m[:, None] < seqlen, other=0.0)
        qk_scale = softmax_scale * 1.4426950408889634  # log2(e): exp2 is the fast path

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if HAS_PREFIX:  # the shared prefix's keys: all of them, for every query of the sample
            p_start = tl.load(PFX + seq * 3)
            p_len = tl.load(PFX + seq * 3 + 1)
            for n0 in range(0, p_len, BLOCK_N):
                offs_n = n0 + offs_n0
                allowed = (offs_m[:, None] < seqlen) & (offs_n[None, :] < p_len)
                m_i, l_i, acc = _online_block(q, K, V, (p_start + offs_n).to(tl.int64), offs_n[:, None] < p_len,
                                              allowed, hk, qk_scale, m_i, l_i, acc,
                                              stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM)
        lo, hi = _key_range(m0, seqlen, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_n0
            allowed = _window_mask(offs_m, offs_n, seqlen, left, right, HAS_LEFT, HAS_RIGHT)
            m_i, l_i, acc = _online_block(q, K, V, (start + offs_n).to(tl.int64), offs_n[:, None] < seqlen,
                                          allowed, hk, qk_scale, m_i, l_i, acc,
                                          stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # natural-log units
        out = acc / l_safe[:, None]
        if HAS_SINK:
            sink = tl.load(SINK + hq).to(tl.float32)
            lse_all = tl.maximum(lse, sink) + tl.log(1.0 + tl.exp(-tl.abs(lse - sink)))
            out = out * tl.exp(lse - lse_all)[:, None]
            lse = lse_all
        row_ok = offs_m < seqlen
        tl.store(LSE + hq * stride_lh + start + offs_m, lse, mask=row_ok)
        tl.store(O + rows_m[:, None] * stride_ot + hq * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None])

    @triton.jit
    def _bwd_preprocess_kernel(
        O, DO, LSE, SINK, DELTA, DSINK_ROWS, T,
        stride_ot, stride_oh, stride_dot, stride_doh, stride_lh,
        HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, HAS_SINK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        hq = tl.program_id(1)
        offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, HEAD_DIM)
        rows = offs_t.to(tl.int64)
        ok = offs_t < T
        o = tl.load(O + rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :], mask=ok[:, None], other=0.0)
        do = tl.load(DO + rows[:, None] * stride_dot + hq * stride_doh + offs_d[None, :], mask=ok[:, None],
                     other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + hq * stride_lh + offs_t, delta, mask=ok)
        if HAS_SINK:
            lse = tl.load(LSE + hq * stride_lh + offs_t, mask=ok, other=0.0)
            sink = tl.load(SINK + hq).to(tl.float32)
            tl.store(DSINK_ROWS + hq * stride_lh + offs_t, -tl.exp(sink - lse) * delta, mask=ok)

    @triton.jit
    def _dkdv_block(Q, DO, LSE, DELTA, rows, row_ok, allowed, hq, k, v, dk, dv, qk_scale,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, HEAD_DIM: tl.constexpr):
        """One query block's share of a key block's dK/dV: queries at packed ``rows`` (those with
        ``row_ok``), the scores kept where ``allowed``."""
        offs_d = tl.arange(0, HEAD_DIM)
        rows_m = rows.to(tl.int64)
        q = tl.load(Q + rows_m[:, None] * stride_qt + hq * stride_qh + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0)
        do = tl.load(DO + rows_m[:, None] * stride_dot + hq * stride_doh + offs_d[None, :], mask=row_ok[:, None],
                     other=0.0)
        lse = tl.load(LSE + hq * stride_lh + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + hq * stride_lh + rows, mask=row_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        p = tl.exp2(qk * qk_scale - lse[:, None] * 1.4426950408889634)
        p = tl.where(allowed, p, 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV, CU, PFX, softmax_scale, left, right,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_PREFIX: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        hk = tl.program_id(1)
        seq = tl.program_id(2)
        start = tl.load(CU + seq)
        seqlen = tl.load(CU + seq + 1) - start
        n0 = pid_n * BLOCK_N
        if n0 >= seqlen:
            return
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        rows_n = (start + offs_n).to(tl.int64)
        kv_mask = offs_n[:, None] < seqlen
        k = tl.load(K + rows_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk_scale = softmax_scale * 1.4426950408889634
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

        # Queries that can see keys [n0, n0 + BLOCK_N): i >= j - right and i <= j + left.
        q_lo = 0
        if HAS_RIGHT:
            q_lo = tl.maximum(0, n0 - right)
            q_lo = (q_lo // BLOCK_M) * BLOCK_M
        q_hi = seqlen
        if HAS_LEFT:
            q_hi = tl.minimum(seqlen, n0 + BLOCK_N + left)
        for g in range(GROUP):
            hq = hk * GROUP + g
            for m0 in range(q_lo, q_hi, BLOCK_M):
                offs_m = m0 + offs_m0
                allowed = _window_mask(offs_m, offs_n, seqlen, left, right, HAS_LEFT, HAS_RIGHT)
                dk, dv = _dkdv_block(Q, DO, LSE, DELTA, start + offs_m, offs_m < seqlen, allowed, hq, k, v, dk, dv,
                                     qk_scale, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, HEAD_DIM)
        if HAS_PREFIX:  # a shared prefix: the samples after it, up to its query end, see every key of it
            q_end = tl.load(PFX + seq * 3 + 2)
            for g in range(GROUP):
                hq = hk * GROUP + g
                for r0 in range(start + seqlen, q_end, BLOCK_M):
                    rows = r0 + offs_m0
                    row_ok = rows < q_end
                    allowed = row_ok[:, None] & (offs_n[None, :] < seqlen)
                    dk, dv = _dkdv_block(Q, DO, LSE, DELTA, rows, row_ok, allowed, hq, k, v, dk, dv, qk_scale,
                                         stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, HEAD_DIM)
        dk = dk * softmax_scale
        tl.store(DK + rows_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=kv_mask)
        tl.store(DV + rows_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=kv_mask)

    @triton.jit
    def _dq_block(q, do, K, V, rows_n, kv_mask, allowed, hk, qk_scale, lse2, delta, dq,
                  stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: tl.constexpr):
        """One key block's share of dQ for keys ``rows_n`` where ``allowed``."""
        offs_d = tl.arange(0, HEAD_DIM)
        k = tl.load(K + rows_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + rows_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        p = tl.exp2(qk * qk_scale - lse2[:, None])
        p = tl.where(allowed, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit
    def _bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, CU, PFX, softmax_scale, left, right,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dqt, stride_dqh, stride_lh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_PREFIX: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        hq = tl.program_id(1)
        seq = tl.program_id(2)
        start = tl.load(CU + seq)
        seqlen = tl.load(CU + seq + 1) - start
        m0 = pid_m * BLOCK_M
        if m0 >= seqlen:
            return
        hk = hq // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        rows_m = (start + offs_m).to(tl.int64)
        q_mask = offs_m[:, None] < seqlen
        q = tl.load(Q + rows_m[:, None] * stride_qt + hq * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO + rows_m[:, None] * stride_dot + hq * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
        lse = tl.load(LSE + hq * stride_lh + start + offs_m, mask=offs_m < seqlen, other=0.0)
        delta = tl.load(DELTA + hq * stride_lh + start + offs_m, mask=offs_m < seqlen, other=0.0)
        qk_scale = softmax_scale * 1.4426950408889634
        lse2 = lse * 1.4426950408889634
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if HAS_PREFIX:
            p_start = tl.load(PFX + seq * 3)
            p_len = tl.load(PFX + seq * 3 + 1)
            for n0 in range(0, p_len, BLOCK_N):
                offs_n = n0 + offs_n0
                allowed = (offs_m[:, None] < seqlen) & (offs_n[None, :] < p_len)
                dq = _dq_block(q, do, K, V, (p_start + offs_n).to(tl.int64), offs_n[:, None] < p_len, allowed, hk,
                               qk_scale, lse2, delta, dq, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM)
        lo, hi = _key_range(m0, seqlen, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_n0
            allowed = _window_mask(offs_m, offs_n, seqlen, left, right, HAS_LEFT, HAS_RIGHT)
            dq = _dq_block(q, do, K, V, (start + offs_n).to(tl.int64), offs_n[:, None] < seqlen, allowed, hk,
                           qk_scale, lse2, delta, dq, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM)
        dq = dq * softmax_scale
        tl.store(DQ + rows_m[:, None] * stride_dqt + hq * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=q_mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

# Tile shapes per head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward, dK/dV, dQ.
# Picked by `python -m bench.attention --sweep` on an H200 (16,384 tokens, lognormal lengths,
# 32 q / 8 kv heads, D=128; docs/benchmarks.md): forward 0.557 -> 0.428 ms with 64x64 tiles
# (short samples waste less of a 128-row block); dK/dV 128x64 tiles and dQ 64x32 tiles took
# 0.37 and 0.51 ms off a 2.32 ms backward. D=64 uses the same shapes (not swept separately).
_FWD_CONFIG = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)}
_BWD_DKDV_CONFIG = {64: (128, 64, 8, 2), 128: (128, 64, 8, 2)}
_BWD_DQ_CONFIG = {64: (64, 32, 4, 2), 128: (64, 32, 4, 2)}
_PREPROCESS_BLOCK_T = 64


def _window_bounds(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if left < -1 or right < -1:
        raise ValueError(f"window: sides must be >= 0 or -1 (unbounded), got {window}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _check_inputs(q, k, v, cu_seqlens, max_seqlen, sinks) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} must share T and D")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[2]} is not supported: use {SUPPORTED_HEAD_DIMS} or the SDPA backend")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among bf16/fp16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v must be contiguous in the head dim (stride(-1) == 1)")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor of N + 1 offsets; got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}: build it on q's device")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a Python int >= 0 (no .item() in the step); got {max_seqlen!r}")
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.device != q.device):
        raise ValueError(f"sinks must be a [{q.shape[1]}] tensor on {q.device}; got {tuple(sinks.shape)} "
                         f"on {sinks.device}")


def _forward(q, k, v, cu_seqlens, max_seqlen, left, right, sinks, scale, prefixes=None):
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    n_seq = cu_seqlens.numel() - 1
    out = torch.empty_like(q)
    lse = torch.empty((Hq, T), device=q.device, dtype=torch.float32)
    bm, bn, warps, stages = _FWD_CONFIG[D]
    grid = (triton.cdiv(max_seqlen, bm), Hq, n_seq)
    if T and max_seqlen:
        _fwd_kernel[grid](
            q, k, v, out, lse, sinks if sinks is not None else lse, cu_seqlens,
            prefixes if prefixes is not None else cu_seqlens, scale, left, right,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0),
            GROUP=group, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
            HAS_SINK=sinks is not None, HAS_PREFIX=prefixes is not None, num_warps=warps, num_stages=stages,
        )
    return out, lse


def _backward(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, sinks, scale, prefixes=None):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    n_seq = cu_seqlens.numel() - 1
    do = do if do.stride(-1) == 1 else do.contiguous()
    delta = torch.empty_like(lse)
    dsink_rows = torch.empty_like(lse) if sinks is not None else delta
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if T == 0 or max_seqlen == 0:
        dsink = torch.zeros_like(sinks) if sinks is not None else None
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink
    _bwd_preprocess_kernel[(triton.cdiv(T, _PREPROCESS_BLOCK_T), Hq)](
        out, do, lse, sinks if sinks is not None else lse, delta, dsink_rows, T,
        out.stride(0), out.stride(1), do.stride(0), do.stride(1), lse.stride(0),
        HEAD_DIM=D, BLOCK_T=_PREPROCESS_BLOCK_T, HAS_SINK=sinks is not None,
    )
    bm, bn, warps, stages = _BWD_DKDV_CONFIG[D]
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, bn), Hkv, n_seq)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens, prefixes if prefixes is not None else cu_seqlens, scale, left,
        right, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
        do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_PREFIX=prefixes is not None, num_warps=warps, num_stages=stages,
    )
    bm, bn, warps, stages = _BWD_DQ_CONFIG[D]
    _bwd_dq_kernel[(triton.cdiv(max_seqlen, bm), Hq, n_seq)](
        q, k, v, do, lse, delta, dq, cu_seqlens, prefixes if prefixes is not None else cu_seqlens, scale, left,
        right, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
        do.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
        GROUP=group, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_PREFIX=prefixes is not None, num_warps=warps, num_stages=stages,
    )
    dsink = dsink_rows.sum(1).to(sinks.dtype) if sinks is not None else None
    return dq, dk, dv, dsink


class FlashVarlenFunction(torch.autograd.Function):
    """Autograd over the Triton kernels: grads for q, k, v and sinks."""

    @staticmethod
    def forward(ctx: Any, q, k, v, cu_seqlens, max_seqlen, left, right, sinks, scale, prefixes):
        out, lse = _forward(q, k, v, cu_seqlens, max_seqlen, left, right, sinks, scale, prefixes)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks, prefixes)
        ctx.args = (max_seqlen, left, right, scale)
        return out

    @staticmethod
    def backward(ctx: Any, do):
        q, k, v, out, lse, cu_seqlens, sinks, prefixes = ctx.saved_tensors
        max_seqlen, left, right, scale = ctx.args
        dq, dk, dv, dsink = _backward(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, sinks, scale,
                                      prefixes)
        return dq, dk, dv, None, None, None, None, dsink, None, None


def flash_varlen_attention(
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
    """Attention over packed samples, each attending only within itself (and its shared prefix).

    Args:
        q: [T, Hq, D] queries, bf16/fp16 (fp32 works, with tf32 dots).
        k, v: [T, Hkv, D] keys and values, ``Hq % Hkv == 0`` (GQA).
        cu_seqlens: int32 [N + 1] sample offsets on q's device, from 0 to T.
        max_seqlen: the longest sample, a Python int (sizes the grid; never read back from the GPU).
        causal: mask keys after the query (within its sample).
        window: flash-attn's ``window_size`` ``(left, right)``; -1 is unbounded; None is no window.
        sinks: optional [Hq] per-head sink logits (GPT-OSS), trainable.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        prefixes: optional int32 [N, 3] on q's device, per sample ``(prefix start row, prefix length,
            query end row)`` (``trainer.data.packed_metadata.prefix_rows`` builds it): the sample's
            queries also see every key of rows ``[start, start + length)`` (a prompt shared by
            several completions, trained once), and a sample that is such a prefix gets the key
            gradients of the query rows after it up to its query end (the samples sharing it must
            follow it, contiguous). ``(0, 0, own end)`` for a sample with neither. Not with a window.

    Returns:
        [T, Hq, D] output in q's dtype.

    Raises:
        ValueError: on shapes, dtypes or devices the kernel does not take.
        RuntimeError: when ``supported`` names a reason the kernel cannot run here.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, sinks)
    if prefixes is not None:
        n = cu_seqlens.numel() - 1
        if prefixes.dtype != torch.int32 or tuple(prefixes.shape) != (n, 3) or prefixes.device != q.device:
            raise ValueError(f"prefixes must be an int32 [{n}, 3] tensor on {q.device}; got {prefixes.dtype} "
                             f"{tuple(prefixes.shape)} on {prefixes.device}")
        if window is not None and int(window[0]) >= 0:
            raise ValueError("prefixes with a left window are not supported: a shared prefix is seen whole")
        prefixes = prefixes.contiguous()
    if triton is None:
        raise RuntimeError("flash_varlen_attention needs Triton: pip install triton, or use the SDPA backend")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"flash_varlen_attention runs on CUDA; q is on {q.device} (use the SDPA backend)")
    left, right = _window_bounds(causal, window)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return FlashVarlenFunction.apply(q, k, v, cu_seqlens, max_seqlen, left, right, sinks, scale, prefixes)


def _interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: the kernels then run on CPU tensors (tests only)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)
