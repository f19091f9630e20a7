"""The varlen attention reference, the kernel's input checks, and the kernel in Triton's interpreter.

The reference is checked against hand-derivable cases (per-sample SDPA, a window of one key,
the sink formula). The Triton kernels run on CPU under ``TRITON_INTERPRET=1`` in a child
process (the interpreter is chosen when the kernels are decorated, at import), compared to the
float64 reference, forward and backward. bf16 is covered on the GPU only
(tests/gpu/test_flash_varlen.py): Triton 3.6's interpreter computes ``tl.dot`` on bf16 wrongly.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.features.attention.reference import reference_varlen_attention
from trainer.kernels.attention import flash_varlen_attention, supported

REPO_ROOT = Path(__file__).resolve().parents[4]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _cu(lengths: list[int]) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32)


def _qkv(T: int, hq: int, hkv: int, d: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hq, d, generator=gen, dtype=dtype), torch.randn(T, hkv, d, generator=gen, dtype=dtype),
            torch.randn(T, hkv, d, generator=gen, dtype=dtype))


class TestReference:
    def test_a_sample_with_a_prefix_attends_as_the_prefix_and_it_concatenated(self):
        from trainer.data.packed_metadata import prefix_rows

        lengths = [4, 3, 5]
        q, k, v = _qkv(12, 4, 2, 16)
        out = reference_varlen_attention(q, k, v, _cu(lengths), 5, prefixes=prefix_rows(lengths, [-1, 0, 0]))
        torch.testing.assert_close(out[:4], reference_varlen_attention(q[:4], k[:4], v[:4], _cu([4]), 4))
        for a, b in ((4, 7), (7, 12)):
            rows = [0, 1, 2, 3, *range(a, b)]
            whole = reference_varlen_attention(q[rows], k[rows], v[rows], _cu([len(rows)]), len(rows))
            torch.testing.assert_close(out[a:b], whole[4:], rtol=1e-12, atol=1e-12)

    def test_matches_sdpa_run_per_sample(self):
        lengths = [3, 17, 1, 9]
        q, k, v = _qkv(sum(lengths), 4, 2, 16)
        out = reference_varlen_attention(q, k, v, _cu(lengths), 17)
        start = 0
        for n in lengths:
            qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
            expected = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0),
                                                      is_causal=True).transpose(0, 1)
            torch.testing.assert_close(out[start:start + n], expected, rtol=1e-12, atol=1e-12)
            start += n

    def test_samples_do_not_see_each_other(self):
        lengths = [5, 7]
        q, k, v = _qkv(12, 2, 2, 8)
        out = reference_varlen_attention(q, k, v, _cu(lengths), 7, causal=False)
        k2, v2 = k.clone(), v.clone()
        k2[5:] += 10.0
        v2[5:] -= 3.0
        out2 = reference_varlen_attention(q, k2, v2, _cu(lengths), 7, causal=False)
        torch.testing.assert_close(out[:5], out2[:5], rtol=0, atol=0)
        assert not torch.allclose(out[5:], out2[5:])

    def test_window_of_zero_left_sees_only_itself(self):
        q, k, v = _qkv(10, 3, 3, 8)
        out = reference_varlen_attention(q, k, v, _cu([4, 6]), 6, causal=True, window=(0, -1))
        torch.testing.assert_close(out, v, rtol=1e-12, atol=1e-12)

    def test_sink_scales_output_by_sigmoid_of_lse_minus_sink(self):
        q, k, v = _qkv(6, 2, 1, 8)
        sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
        out = reference_varlen_attention(q, k, v, _cu([6]), 6, sinks=sinks)
        plain = reference_varlen_attention(q, k, v, _cu([6]), 6)
        scores = torch.einsum("thd,shd->hts", q, k.expand(6, 2, 8)) / math.sqrt(8)
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # [T, H]
        torch.testing.assert_close(out, plain * torch.sigmoid(lse - sinks)[..., None], rtol=1e-12, atol=1e-12)

    def test_rejects_offsets_that_do_not_cover_the_rows(self):
        q, k, v = _qkv(10, 2, 2, 8)
        with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=10"):
            reference_varlen_attention(q, k, v, _cu([4, 5]), 5)

    def test_rejects_max_seqlen_below_longest_sample(self):
        q, k, v = _qkv(10, 2, 2, 8)
        with pytest.raises(ValueError, match="max_seqlen=4 is below the longest sample"):
            reference_varlen_attention(q, k, v, _cu([4, 6]), 4)


class TestInputChecks:
    def test_supported_names_a_reason_on_this_box(self):
        reason = supported("cpu", head_dim=128)
        if not HAS_TRITON:
            assert "Triton" in reason
        else:
            assert reason is not None and ("CUDA" in reason or "cuda" in reason)

    def test_supported_rejects_head_dim(self):
        if HAS_TRITON:
            assert "head dim 96" in supported("cpu", head_dim=96)

    @pytest.mark.parametrize(
        ("prefixes", "window", "message"),
        [
            (torch.zeros(2, 3, dtype=torch.int32), None, r"int32 \[1, 3\]"),
            (torch.zeros(1, 3, dtype=torch.int64), None, "int32"),
            (torch.zeros(1, 3, dtype=torch.int32), (4, 0), "left window"),
        ],
    )
    def test_bad_prefixes_get_a_clear_error(self, prefixes, window, message):
        q, k, v = _qkv(8, 4, 2, 64, dtype=torch.float16)
        with pytest.raises(ValueError, match=message):
            flash_varlen_attention(q, k, v, _cu([8]), 8, window=window, prefixes=prefixes)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"d": 96}, "head dim 96 is not supported"),
            ({"hkv": 3}, "multiple of key/value heads"),
            ({"cu_dtype": torch.int64}, "int32"),
            ({"max_seqlen": torch.tensor(8)}, "Python int"),
        ],
    )
    def test_bad_inputs_get_a_clear_error(self, change, message):
        d, hkv = change.get("d", 64), change.get("hkv", 2)
        q, k, v = _qkv(8, 4, hkv, d, dtype=torch.float16)
        cu = _cu([8]).to(change.get("cu_dtype", torch.int32))
        with pytest.raises(ValueError, match=message):
            flash_varlen_attention(q, k, v, cu, change.get("max_seqlen", 8))


# Cases run in the interpreter: (lengths, Hq, Hkv, D, causal, window, sinks, dtype, prefixes).
# Prefixes (GRPO's shared prompts): per sample, the earlier sample whose keys it also sees, or -1;
# the prefix's own key blocks then take the gradients of the 4-5 samples after it (past a tile).
INTERPRETER_CASES = [
    ([5, 70, 1, 33], 4, 2, 64, True, None, False, "float32", None),
    ([5, 70, 1, 33], 4, 1, 64, True, (8, -1), True, "float32", None),
    ([40, 130], 2, 2, 64, False, None, False, "float32", None),
    ([40, 130], 2, 2, 64, False, (16, 4), True, "float32", None),
    ([1, 1, 65], 8, 1, 128, True, None, True, "float16", None),
    ([129], 2, 2, 128, True, (31, -1), False, "float16", None),
    ([0, 20, 0, 9], 4, 2, 64, True, (3, -1), True, "float32", None),
    ([40, 5, 70, 1, 33, 9, 3, 2], 4, 2, 64, True, None, False, "float32", [-1, 0, 0, 0, 0, -1, 5, 5]),
    ([65, 3, 33, 20, 17, 1, 40], 4, 1, 64, True, None, True, "float32", [-1, 0, 0, -1, 3, 3, 3]),
    ([1, 66, 2], 2, 2, 128, True, None, False, "float16", [-1, 0, 0]),
]
TOLERANCE = {"float32": 1e-5, "float16": 3e-3}
"""Relative L2 error ||x - ref|| / ||ref||: fp32 lands near 1e-7, fp16 operands near 3e-4."""


@pytest.fixture(scope="module")
def interpreter_errors() -> list[list[float]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.slow  # ~11 s: the Triton interpreter in a child process
class TestKernelInInterpreter:
    @pytest.mark.parametrize("index", range(len(INTERPRETER_CASES)))
    def test_forward_and_grads_match_float64_reference(self, interpreter_errors, index):
        dtype = INTERPRETER_CASES[index][7]
        names = ["out", "dq", "dk", "dv", "dsinks"]
        errors = dict(zip(names, interpreter_errors[index]))
        assert all(math.isfinite(e) and e < TOLERANCE[dtype] for e in errors.values()), errors


def _run_interpreter_cases() -> list[list[float]]:
    """Child-process body: run every case through the kernels and report relative errors.

    Small tiles, unequal between the query and key sides, keep the interpreter fast and put
    block edges inside the samples (the GPU tests run the production tiles).
    """
    from trainer.kernels import attention as fv

    _patch_interpreter_index()
    for d in fv.SUPPORTED_HEAD_DIMS:
        fv._FWD_CONFIG[d] = (64, 32, 4, 1)
        fv._BWD_DKDV_CONFIG[d] = (32, 64, 4, 1)
        fv._BWD_DQ_CONFIG[d] = (64, 32, 4, 1)
    results = []
    from trainer.data.packed_metadata import prefix_rows

    for lengths, hq, hkv, d, causal, window, with_sinks, dtype_name, prefix_of in INTERPRETER_CASES:
        prefixes = None if prefix_of is None else prefix_rows(lengths, prefix_of)
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(len(results))
        T = sum(lengths)
        leaves = [torch.randn(T, h, d, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv)]
        if with_sinks:
            leaves.append(torch.randn(hq, requires_grad=True))
        sinks = leaves[3] if with_sinks else None
        out = flash_varlen_attention(*leaves[:3], _cu(lengths), max(lengths), causal=causal, window=window,
                                     sinks=sinks, prefixes=prefixes)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
        ref = reference_varlen_attention(*ref_leaves[:3], _cu(lengths), max(lengths), causal=causal, window=window,
                                         sinks=ref_leaves[3] if with_sinks else None, prefixes=prefixes)
        ref.backward(grad.double())
        errors = [((out.double() - ref).norm() / ref.norm()).item()]
        errors += [((a.grad.double() - b.grad).norm() / b.grad.norm()).item() for a, b in zip(leaves, ref_leaves)]
        results.append(errors)
    return results


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter calls ``int()`` on 1-element arrays, which numpy >= 2.4 refuses."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    print(json.dumps(_run_interpreter_cases()))
