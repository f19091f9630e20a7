"""The Triton varlen flash-attention kernel on a GPU, against the float64 per-sample reference.

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_flash_varlen.py``. Skipped without
CUDA. Inputs are fresh random draws per case (never zeros); errors are relative L2,
``||x - ref|| / ||ref||``, and the worst element relative to the reference's scale,
``max|x - ref| / max|ref|``.
"""

from __future__ import annotations

import math
import warnings
import zlib

import pytest
import torch

from trainer.features.attention.reference import reference_varlen_attention
from trainer.kernels.attention import flash_varlen_attention, supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REL_L2 = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""bf16 operands land near 4e-3, fp16 near 5e-4 (8x less mantissa error): a 4-10x margin."""
MAX_REL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Worst element over the reference's largest magnitude."""


def _lognormal_lengths(total: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(math.exp(math.log(250) + torch.randn(1, generator=gen).item()))
        lengths.append(min(max(n, 16), 4096, total - sum(lengths)))
    return lengths


LENGTH_MIXES = {
    "one_long": [2048],
    "many_short": [int(x) for x in torch.randint(1, 48, (120,), generator=torch.Generator().manual_seed(1))],
    "all_ones": [1] * 33,
    "off_block_sizes": [127, 129, 63, 65, 1000, 3],
    "zero_length_samples": [0, 50, 0, 70, 0],
    "lognormal_8k": _lognormal_lengths(8192, seed=0),
}

# (mix, Hq, Hkv, D, causal, window, sinks, dtype)
CASES = [
    *[(mix, 8, 2, 128, True, None, False, torch.bfloat16) for mix in LENGTH_MIXES],
    ("off_block_sizes", 8, 8, 64, True, None, False, torch.bfloat16),
    ("off_block_sizes", 8, 1, 64, True, None, False, torch.bfloat16),
    ("off_block_sizes", 8, 8, 128, True, None, False, torch.float16),
    ("off_block_sizes", 16, 2, 64, True, (128, -1), False, torch.bfloat16),
    ("one_long", 8, 1, 128, True, (255, -1), True, torch.bfloat16),
    ("off_block_sizes", 8, 2, 128, False, None, False, torch.bfloat16),
    ("off_block_sizes", 8, 2, 64, False, (40, 17), True, torch.float16),
    ("many_short", 8, 8, 64, True, None, True, torch.bfloat16),
    ("lognormal_8k", 32, 8, 128, True, None, True, torch.bfloat16),
    ("lognormal_8k", 16, 8, 64, True, (128, -1), True, torch.bfloat16),
]


def _case_id(case) -> str:
    mix, hq, hkv, d, causal, window, sinks, dtype = case
    parts = [mix, f"h{hq}x{hkv}", f"d{d}", "causal" if causal else "full", str(dtype).split(".")[-1]]
    if window:
        parts.append(f"win{window[0]}_{window[1]}")
    if sinks:
        parts.append("sinks")
    return "-".join(parts)


def _cu(lengths: list[int], device) -> torch.Tensor:
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return offsets.to(device=device, dtype=torch.int32)


def _errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = x.double() - ref
    return (diff.norm() / ref.norm().clamp_min(1e-30)).item(), (diff.abs().max() / ref.abs().max()).item()


@pytest.fixture(autouse=True)
def _needs_kernel():
    reason = supported("cuda")
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_and_backward_match_float64_reference(case):
    mix, hq, hkv, d, causal, window, with_sinks, dtype = case
    lengths = LENGTH_MIXES[mix]
    T, dev = sum(lengths), torch.device("cuda")
    cu = _cu(lengths, dev)
    torch.manual_seed(zlib.crc32(_case_id(case).encode()))
    leaves = [torch.randn(T, h, d, device=dev, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv)]
    if with_sinks:
        leaves.append(torch.randn(hq, device=dev, dtype=torch.float32, requires_grad=True))
    sinks = leaves[3] if with_sinks else None

    out = flash_varlen_attention(*leaves[:3], cu, max(lengths), causal=causal, window=window, sinks=sinks)
    grad = torch.randn_like(out)
    out.backward(grad)

    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = reference_varlen_attention(*ref_leaves[:3], cu, max(lengths), causal=causal, window=window,
                                     sinks=ref_leaves[3] if with_sinks else None)
    ref.backward(grad.double())

    names = ["out", "dq", "dk", "dv", "dsinks"]
    got = [out] + [x.grad for x in leaves]
    want = [ref] + [x.grad for x in ref_leaves]
    for name, x, r in zip(names, got, want):
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
        if r.abs().max() < 1e-6:  # e.g. dq with one-token samples: softmax over one key ignores q
            assert (x.double() - r).abs().max() < 1e-2, f"{name}: reference is 0, got max |x| {x.abs().max():.2e}"
            continue
        rel_l2, max_rel = _errors(x, r)
        tol_l2 = REL_L2[dtype] if name != "dsinks" else 2 * REL_L2[dtype]
        assert rel_l2 < tol_l2, f"{name}: relative L2 error {rel_l2:.2e} >= {tol_l2:.0e}"
        if name != "dsinks":
            assert max_rel < MAX_REL[dtype], f"{name}: worst element {max_rel:.2e} of max|ref| >= {MAX_REL[dtype]}"


# GRPO's shared prompts (``trainer.data.packed_metadata``'s prefixes): two groups, each a prompt
# but its last token and G samples of its last token and a completion that see it as their prefix.
PREFIX_CASES = {
    "grpo_8b_shape": ([255] + [513, 300, 1, 513, 77, 513, 129, 400] + [60] + [64] * 4, 32, 8, 128, False),
    "sinks_d64": ([65, 130, 3, 200, 1, 63] + [1] + [40, 41], 16, 2, 64, True),
}


def _prefix_of(lengths: list[int], heads: tuple[int, int]) -> list[int]:
    """Sample 0 is the prefix of samples 1..8 (group one), sample 9 of the rest, per the cases above."""
    first, second = heads
    return [-1 if s in (first, second) else (first if s < second else second) for s in range(len(lengths))]


@pytest.mark.parametrize("name", PREFIX_CASES)
def test_shared_prefixes_match_float64_reference(name):
    from trainer.data.packed_metadata import prefix_rows

    lengths, hq, hkv, d, with_sinks = PREFIX_CASES[name]
    heads = (0, 9) if name == "grpo_8b_shape" else (0, 6)
    dev = torch.device("cuda")
    T, cu = sum(lengths), _cu(lengths, dev)
    prefixes = prefix_rows(lengths, _prefix_of(lengths, heads)).to(dev)
    torch.manual_seed(zlib.crc32(name.encode()))
    leaves = [torch.randn(T, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv)]
    if with_sinks:
        leaves.append(torch.randn(hq, device=dev, dtype=torch.float32, requires_grad=True))
    sinks = leaves[3] if with_sinks else None
    out = flash_varlen_attention(*leaves[:3], cu, max(lengths), sinks=sinks, prefixes=prefixes)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = reference_varlen_attention(*ref_leaves[:3], cu, max(lengths), sinks=ref_leaves[3] if with_sinks else None,
                                     prefixes=prefixes)
    ref.backward(grad.double())
    for label, x, r in zip(["out", "dq", "dk", "dv", "dsinks"], [out] + [x.grad for x in leaves],
                           [ref] + [x.grad for x in ref_leaves]):
        rel_l2, max_rel = _errors(x, r)
        tol = REL_L2[torch.bfloat16] * (2 if label == "dsinks" else 1)
        assert rel_l2 < tol, f"{label}: relative L2 error {rel_l2:.2e} >= {tol:.0e}"
        if label != "dsinks":
            assert max_rel < MAX_REL[torch.bfloat16], f"{label}: worst element {max_rel:.2e}"


def test_a_sample_is_unchanged_when_its_neighbour_changes():
    lengths, dev = [100, 200, 37], torch.device("cuda")
    cu = _cu(lengths, dev)
    q, k, v = (torch.randn(337, h, 128, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2))
    out = flash_varlen_attention(q, k, v, cu, 200)
    k2, v2 = k.clone(), v.clone()
    k2[100:300] = torch.randn_like(k2[100:300])
    v2[100:300] = torch.randn_like(v2[100:300])
    out2 = flash_varlen_attention(q, k2, v2, cu, 200)
    assert torch.equal(out[:100], out2[:100]) and torch.equal(out[300:], out2[300:])
    assert not torch.equal(out[100:300], out2[100:300])


def test_forward_and_backward_make_no_host_sync():
    lengths, dev = _lognormal_lengths(4096, seed=3), torch.device("cuda")
    cu = _cu(lengths, dev)
    leaves = [torch.randn(4096, h, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (16, 8, 8)]
    sinks = torch.randn(16, device=dev, requires_grad=True)
    grad = torch.randn(4096, 16, 128, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # torch warns that the sync debugger is a prototype
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        out = flash_varlen_attention(*leaves, cu, max(lengths), sinks=sinks)
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(x.grad is not None for x in leaves) and sinks.grad is not None


def test_bf16_output_is_deterministic():
    lengths, dev = _lognormal_lengths(4096, seed=4), torch.device("cuda")
    cu = _cu(lengths, dev)
    leaves = [torch.randn(4096, h, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2)]
    grad = torch.randn(4096, 8, 64, device=dev, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        for x in leaves:
            x.grad = None
        out = flash_varlen_attention(*leaves, cu, max(lengths))
        out.backward(grad)
        runs.append([out.detach().clone()] + [x.grad.clone() for x in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "same inputs gave different results: a race"
