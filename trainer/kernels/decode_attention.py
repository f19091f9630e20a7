"""Decode attention in Triton: one query token per sequence against its slot of the sampler's cache.

Why: the sampler's ``torch`` backend (``trainer.generate.attention.attend_cached``) gathers every
decoding slot's keys and values up to the longest position and upcasts them to fp32 before two
batched matmuls: at batch 256 and 512 positions that is ~1 GB moved per layer per step, several
times the cache itself. This kernel reads the slot-major cache ``[slots, Hkv, max_len, D]`` in
place, through the step's slot index, each sequence only up to its own length: the keys and
values are read once, in their dtype, and nothing is gathered or copied.

Algorithm (flash-decoding):
- stage 1: one program per (sequence, kv head, split). Its ``G = Hq / Hkv`` query heads (GQA)
  are the rows of one ``[BLOCK_H, D]`` tile (padded to 16, tl.dot's least M), so each key block is
  loaded once for the whole group. The split's keys are a contiguous chunk of the sequence's
  visible range ``[lo, length)`` (``lo = length - window`` under a sliding window, else 0); an
  online softmax in fp32 runs over ``BLOCK_N`` keys at a time (scores ``q.k * scale``, then
  ``softcap * tanh(s / softcap)`` when soft-capped). With one split the program normalizes and
  writes the output row; with several it writes its partial ``(max, sum, acc)`` in fp32.
- stage 2 (several splits only): one program per (sequence, query head) merges the splits'
  partials (log-sum-exp weights).
- GPT-OSS sinks (``s_aux``): one extra logit per query head in the denominator, no value, added
  where the row is normalized (stage 1 or 2) against the running max, so a large sink cannot
  overflow ``exp``.

Shared prompts (``trainer.generate.cache``'s shared-prompt layout, ``prompt=``): a sequence's
positions below its prompt length are read from its prompt slot of the prompt store, the rest from
its own slot at ``position - prompt length`` (its own base pointer shifted back by the prompt
length). The online softmax still runs over the same ``BLOCK_N`` runs of logical positions: each
position is loaded from one of the two stores (two masked loads and a select; a block that lies
in one range issues no memory traffic for the other), so the blocks, the running maxima and every
rounding are the unshared layout's and the outputs are bitwise the same on the same keys. A
sliding window's low bound may fall inside the prompt: the range ``[lo, length)`` is the same.

Splits: ``plan_splits`` gives one split when the sequences x kv heads fill the GPU (~2 programs
per SM) and otherwise divides the longest context into chunks of at least ``MIN_SPLIT_KEYS``
keys, so batch 1 with a long prompt still runs ~2 programs per SM. It reads only host numbers
(no sync). Masking a position is by range, not by mask: a sequence's keys past its length are
never loaded, so stale keys of an earlier sequence in the slot are never read.

Numerics: scores and softmax in fp32 (``tl.dot`` accumulates in fp32; for fp32 inputs it runs
in IEEE precision, not tf32); the unnormalized probabilities are rounded to the values' dtype
before ``p @ v`` (the torch backend rounds the normalized ones), so bf16 outputs differ from it
by about a bf16 ulp. Under the CPU interpreter the dot operands are upcast to fp32 first (see
``decode_attention``), which computes the same values.

Shapes (legend): ``T`` tokens of the step's row, ``S`` decoding sequences, ``Hq``/``Hkv`` query /
key-value heads, ``D`` head dim, ``C`` cache slots, ``L`` cache positions per slot, ``P`` splits.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CPU boxes have none; the sampler then keeps its torch backend.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on boxes without triton
    triton = None
    tl = None

BLOCK_N = 64
"""Keys per iteration of the online softmax."""
NUM_WARPS = 4
NUM_STAGES = 2
# Chosen by a sweep on one H100 (BLOCK_N 32/64/128 x warps 4/8 x stages 2/3/4, Llama-3.1-8B's
# 32/8 heads of 128, bf16): this one reads K+V at 2.74 TB/s at batch 256 x 512 positions (196 us)
# and 2.53 TB/s at batch 64 x 1,024, within 2% of the best at both; batch 1 x 4,000 takes 25 us
# (3 splits; 8 warps or deeper pipelines were up to 3x slower there).
MIN_SPLIT_KEYS = 256
"""Fewest keys a split reads: below that the reduce costs more than the parallelism gains."""
PROGRAMS_PER_SM = 2
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot run on ``device`` for a cache of ``dtype`` and ``head_dim``, or None.

    CPU tensors run it only under Triton's interpreter (``TRITON_INTERPRET=1``, which Triton itself
    reads when kernels are decorated; the CPU tests run it so)."""
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {device} is not a CUDA device"
    if dtype not in SUPPORTED_DTYPES:
        return f"cache dtype {dtype} is not one of bf16, fp16, fp32"
    if head_dim < 16 or head_dim > 256:
        return f"head dim {head_dim} is outside 16..256"
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        major, minor = torch.cuda.get_device_capability(device)
        return f"CUDA capability {major}.{minor} is below 8.0 (Ampere); the kernel's bf16 dots need it"
    return None


def plan_splits(seqs: int, kv_heads: int, max_len: int, sm_count: int) -> int:
    """Splits per (sequence, kv head): 1 when ``seqs * kv_heads`` programs fill ``sm_count`` SMs,
    else enough to reach ``PROGRAMS_PER_SM`` programs per SM, each of ``MIN_SPLIT_KEYS`` keys or more."""
    programs = seqs * kv_heads
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    by_length = max(1, max_len // MIN_SPLIT_KEYS)
    return max(1, min(wanted, by_length))


if triton is not None:

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _load_keys(base, prompt_base, keys_n, prompt_len, stride_l, stride_pl, offs_d, nd_mask,
                   HAS_PROMPT: tl.constexpr):
        """[BLOCK_N, BLOCK_D] rows ``keys_n`` of one sequence: below ``prompt_len`` from its prompt
        slot (``prompt_base``), the rest from its own slot (``base``, already shifted back by
        ``prompt_len`` positions); each position is loaded from one of the two."""
        if HAS_PROMPT:
            in_prompt = keys_n < prompt_len
            own = tl.load(base + keys_n[:, None] * stride_l + offs_d[None, :],
                          mask=nd_mask & (keys_n >= prompt_len)[:, None], other=0.0)
            shared = tl.load(prompt_base + keys_n[:, None] * stride_pl + offs_d[None, :],
                             mask=nd_mask & in_prompt[:, None], other=0.0)
            return tl.where(in_prompt[:, None], shared, own)
        return tl.load(base + keys_n[:, None] * stride_l + offs_d[None, :], mask=nd_mask, other=0.0)

    @triton.jit
    def _online_softmax(q, k_base, v_base, pk_base, pv_base, prompt_len, start, end, stride_kl, stride_vl,
                        stride_pkl, stride_pvl, scale, softcap, d_mask,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, HAS_PROMPT: tl.constexpr, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr):
        """Running (max, sum, unnormalized output) of ``q``'s rows over keys [start, end).

        The blocks are the same ``BLOCK_N`` runs of positions whether the prompt is shared or not
        (a block may straddle the prompt's end), so both layouts compute the same values."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        # A finite start: a split whose keys are all out of range keeps exp(-inf - start) = 0 and
        # never computes -inf - -inf.
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            keys_n = n0 + offs_n
            n_mask = keys_n < end
            nd_mask = n_mask[:, None] & d_mask[None, :]
            k = _load_keys(k_base, pk_base, keys_n, prompt_len, stride_kl, stride_pkl, offs_d, nd_mask, HAS_PROMPT)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load_keys(v_base, pv_base, keys_n, prompt_len, stride_vl, stride_pvl, offs_d, nd_mask, HAS_PROMPT)
            p = p.to(v.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _slot_base(X, SLOTS, seq, kvh, stride_c, stride_h):
        """Where sequence ``seq``'s slot's kv head ``kvh`` starts in the store ``X``."""
        return X + tl.load(SLOTS + seq).to(tl.int64) * stride_c + kvh.to(tl.int64) * stride_h

    @triton.jit
    def _decode_kernel(
        Q, K, V, O, PART_ACC, PART_M, PART_L, SINK, ROWS, SLOTS, LENS, PK, PV, PSLOTS, PLENS,
        scale, softcap, window, n_splits,
        stride_qt, stride_qh, stride_kc, stride_kh, stride_kl, stride_vc, stride_vh, stride_vl,
        stride_pkc, stride_pkh, stride_pkl, stride_pvc, stride_pvh, stride_pvl, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
        HAS_PROMPT: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(ROWS + seq).to(tl.int64)
        slot = tl.load(SLOTS + seq).to(tl.int64)
        length = tl.load(LENS + seq).to(tl.int32)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(length - window, 0)
        chunk = tl.cdiv(tl.cdiv(length - lo, n_splits), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, length)

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + offs_h
        h_mask = offs_h < GROUP
        d_mask = offs_d < HEAD_DIM
        hd_mask = h_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + slot * stride_kc + kvh.to(tl.int64) * stride_kh
        v_base = V + slot * stride_vc + kvh.to(tl.int64) * stride_vh
        prompt_len, pk_base, pv_base = 0, k_base, v_base
        if HAS_PROMPT:  # own positions start at the prompt's length: shift the own bases back by it
            prompt_len = tl.load(PLENS + seq).to(tl.int32)
            pk_base = _slot_base(PK, PSLOTS, seq, kvh, stride_pkc, stride_pkh)
            pv_base = _slot_base(PV, PSLOTS, seq, kvh, stride_pvc, stride_pvh)
            k_base -= prompt_len.to(tl.int64) * stride_kl
            v_base -= prompt_len.to(tl.int64) * stride_vl

        m_i, l_i, acc = _online_softmax(
            q, k_base, v_base, pk_base, pv_base, prompt_len, start, end, stride_kl, stride_vl, stride_pkl,
            stride_pvl, scale, softcap, d_mask, BLOCK_H, BLOCK_D, BLOCK_N, HAS_SOFTCAP, HAS_PROMPT, PRECISION,
            UPCAST)
        if SPLIT:
            part = (seq * n_splits + split).to(tl.int64) * (GROUP * tl.num_programs(1)) + heads
            tl.store(PART_M + part, m_i, mask=h_mask)
            tl.store(PART_L + part, l_i, mask=h_mask)
            tl.store(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=hd_mask)
        else:
            if HAS_SINK:
                sink = tl.load(SINK + heads, mask=h_mask, other=0.0).to(tl.float32)
                m_all = tl.maximum(m_i, sink)
                keep = tl.exp(m_i - m_all)
                l_i = l_i * keep + tl.exp(sink - m_all)
                acc = acc * keep[:, None]
            out = acc / l_i[:, None]
            o_ptr = O + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=hd_mask)

    @triton.jit
    def _reduce_kernel(
        O, PART_ACC, PART_M, PART_L, SINK, ROWS, n_splits, stride_ot, stride_oh,
        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_SINK: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.load(ROWS + seq).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        p_mask = offs_p < n_splits
        d_mask = offs_d < HEAD_DIM
        part = (seq * n_splits + offs_p).to(tl.int64) * HEADS + head
        m_p = tl.load(PART_M + part, mask=p_mask, other=-1.0e30)
        l_p = tl.load(PART_L + part, mask=p_mask, other=0.0)
        acc_p = tl.load(PART_ACC + part[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        m_all = tl.max(m_p, axis=0)
        if HAS_SINK:
            sink = tl.load(SINK + head).to(tl.float32)
            m_all = tl.maximum(m_all, sink)
        weight = tl.exp(m_p - m_all)
        l_all = tl.sum(l_p * weight, axis=0)
        if HAS_SINK:
            l_all += tl.exp(sink - m_all)
        out = tl.sum(acc_p * weight[:, None], axis=0) / l_all
        tl.store(O + row * stride_ot + head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_mask)


def decode_attention(
    query_THD: torch.Tensor, keys_CHLD: torch.Tensor, values_CHLD: torch.Tensor, rows_S: torch.Tensor,
    slots_S: torch.Tensor, lengths_S: torch.Tensor, out_THD: torch.Tensor, scale: float, max_len: int, *,
    window: int | None = None, sinks_Hq: torch.Tensor | None = None, softcap: float | None = None,
    splits: int | None = None, prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write into ``out_THD[rows_S]`` each decoding query's attention over its sequence's first
    ``lengths_S`` cached keys (its own key included: the cache already holds this step's).

    Args:
        query_THD: [T, Hq, D] the step's queries (rows not in ``rows_S`` are neither read nor written).
        keys_CHLD, values_CHLD: [C, Hkv, L, D] one layer's cache, last dim contiguous.
        rows_S, slots_S, lengths_S: [S] each sequence's row in ``query_THD``, its cache slot and
            its length (position + 1), on the device.
        max_len: the largest of ``lengths_S`` (a host number: it sizes the splits; no sync).
        window: a token sees this many positions, itself included (None: all).
        sinks_Hq: GPT-OSS sink logits, one per query head.
        softcap: logit soft-capping (Gemma 2).
        splits: split-K count (default ``plan_splits`` for the current device).
        prompt: the shared-prompt layout (module docstring): the layer's prompt store's keys and
            values [Cp, Hkv, Lp, D], each sequence's prompt slot and prompt length [S]. None: unshared.
    """
    seqs = rows_S.shape[0]
    heads_q, head_dim = query_THD.shape[1], query_THD.shape[2]
    heads_kv = keys_CHLD.shape[1]
    assert heads_q % heads_kv == 0, f"{heads_q} query heads are not a multiple of {heads_kv} kv heads"
    stores = (keys_CHLD, values_CHLD) + (prompt[:2] if prompt is not None else ())
    assert query_THD.stride(2) == out_THD.stride(2) == 1 and all(t.stride(3) == 1 for t in stores), (
        f"head dims must be contiguous: strides {query_THD.stride()}, {[t.stride() for t in stores]}, "
        f"{out_THD.stride()}")
    if seqs == 0:
        return
    if splits is None:
        splits = plan_splits(seqs, heads_kv, max_len, _sm_count(query_THD.device))
    group, block_d = heads_q // heads_kv, triton.next_power_of_2(head_dim)
    # Triton 3.7's interpreter gets bf16 tl.dot wrong (~1e10 off): on the CPU the operands go
    # to fp32 first, which is exact for the products and the same rounding of p as on the GPU.
    interpreted = query_THD.device.type != "cuda"
    part_acc, part_m, part_l = _partials(seqs, splits, heads_q, head_dim, out_THD)
    sink = sinks_Hq.contiguous() if sinks_Hq is not None else out_THD
    prompt_keys, prompt_values, prompt_slots, prompt_lens = prompt or (keys_CHLD, values_CHLD, slots_S, lengths_S)
    _decode_kernel[(seqs, heads_kv, splits)](
        query_THD, keys_CHLD, values_CHLD, out_THD, part_acc, part_m, part_l, sink, rows_S, slots_S, lengths_S,
        prompt_keys, prompt_values, prompt_slots, prompt_lens,
        float(scale), float(softcap) if softcap is not None else 1.0, int(window) if window is not None else 0,
        splits, query_THD.stride(0), query_THD.stride(1), *keys_CHLD.stride()[:3], *values_CHLD.stride()[:3],
        *prompt_keys.stride()[:3], *prompt_values.stride()[:3], out_THD.stride(0), out_THD.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=BLOCK_N, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINK=sinks_Hq is not None, HAS_PROMPT=prompt is not None, SPLIT=splits > 1,
        PRECISION="ieee" if query_THD.dtype == torch.float32 or interpreted else "tf32",
        UPCAST=interpreted,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if splits > 1:
        _merge_splits(out_THD, (part_acc, part_m, part_l), sink, rows_S, splits, sinks_Hq is not None)


def _merge_splits(out_THD: torch.Tensor, parts: tuple[torch.Tensor, ...], sink: torch.Tensor,
                  rows_S: torch.Tensor, splits: int, has_sink: bool) -> None:
    """Stage 2: each (sequence, query head)'s splits merged into its output row."""
    heads_q, head_dim = out_THD.shape[1], out_THD.shape[2]
    _reduce_kernel[(rows_S.shape[0], heads_q)](
        out_THD, *parts, sink, rows_S, splits, out_THD.stride(0), out_THD.stride(1),
        HEADS=heads_q, HEAD_DIM=head_dim, BLOCK_P=triton.next_power_of_2(splits),
        BLOCK_D=triton.next_power_of_2(head_dim), HAS_SINK=has_sink, num_warps=4,
    )


def _partials(seqs: int, splits: int, heads_q: int, head_dim: int,
              out_THD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's fp32 partial output [S, P, Hq, D], max and sum [S, P, Hq] (unused placeholders
    for one split)."""
    if splits == 1:
        return out_THD, out_THD, out_THD
    acc = torch.empty(seqs, splits, heads_q, head_dim, dtype=torch.float32, device=out_THD.device)
    m = torch.empty(seqs, splits, heads_q, dtype=torch.float32, device=out_THD.device)
    return acc, m, torch.empty_like(m)


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """The device's SM count (memoized; 4 for the CPU, where only the interpreter runs)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
