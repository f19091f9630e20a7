"""RoPE kernel (``trainer.kernels.rope``): in Triton's interpreter against a float64 reference, and
the CPU path against transformers' own ``apply_rotary_pos_emb``.

The kernel runs on CPU under ``TRITON_INTERPRET=1`` in a child process (the interpreter is chosen
when kernels are decorated, at import). Tolerance: relative L2 error < 1e-6 in float32 (one
rotation in float32, the reference in float64), < 5e-3 in float16.
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

from trainer.kernels.rope import apply_rotary, apply_rotary_pos_emb, reference_rotary

REPO_ROOT = Path(__file__).resolve().parents[4]
HAS_TRITON = importlib.util.find_spec("triton") is not None

# (B, H, T, D, dtype, transposed layout like transformers' view(...).transpose(1, 2), one shared
# table, the incoming gradient expanded along the batch: stride 0, its output must not overlap)
CASES = [
    (1, 4, 37, 64, "float32", True, False, False),
    (2, 3, 70, 128, "float32", False, False, False),
    (2, 2, 33, 32, "float16", True, True, False),
    (3, 2, 20, 64, "float32", True, False, True),
]
TOLERANCE = {"float32": 1e-6, "float16": 5e-3}


def _tables(B: int, T: int, D: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """cos/sin as transformers builds them: positions x inverse frequencies, both halves equal."""
    pos = torch.randint(0, 4000, (B, T), generator=gen).double()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _case_errors(B, H, T, D, dtype_name, transposed, shared, expanded_grad) -> list[float]:
    from trainer.kernels.rope import _Rotary

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(B * 1000 + T)
    if transposed:
        x = torch.randn(B, T, H, D, generator=gen).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(B, H, T, D, generator=gen).to(dtype)
    x.requires_grad_()
    cos, sin = _tables(1 if shared else B, T, D, dtype, gen)
    grad = torch.randn(x.shape, generator=gen).to(dtype)
    if expanded_grad:
        grad = grad[:1].expand_as(grad)
    c, s = (cos.expand(B, -1, -1), sin.expand(B, -1, -1)) if shared else (cos, sin)
    out = _Rotary.apply(x, c, s)
    (dx,) = torch.autograd.grad(out, x, grad)
    x64 = x.detach().double().requires_grad_()
    ref = reference_rotary(x64, cos.double(), sin.double())
    (ref_dx,) = torch.autograd.grad(ref, x64, grad.double())
    assert out.stride() == x.stride()
    return [
        ((out.double() - ref).norm() / ref.norm()).item(),
        ((dx.double() - ref_dx).norm() / ref_dx.norm()).item(),
    ]


@pytest.fixture(scope="module")
def interpreter_errors() -> list[list[float]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, __file__], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("index", range(len(CASES)))
@pytest.mark.slow  # ~5 s: the Triton interpreter in a child process
def test_kernel_matches_float64_reference_forward_and_backward(interpreter_errors, index) -> None:
    errors = interpreter_errors[index]
    tol = TOLERANCE[CASES[index][4]]
    assert all(math.isfinite(e) and e < tol for e in errors), errors


def test_cpu_path_is_transformers_formula_exactly() -> None:
    from transformers.models.llama import modeling_llama

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 19, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 19, 64, generator=gen).to(torch.bfloat16)
    cos, sin = _tables(2, 19, 64, torch.bfloat16, gen)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(apply_rotary(q, cos, sin), want[0])


if __name__ == "__main__":  # child process: TRITON_INTERPRET=1
    print(json.dumps([_case_errors(*case) for case in CASES]))
