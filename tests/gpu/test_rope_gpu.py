"""RoPE kernel (``trainer.kernels.rope``) on CUDA: bf16 at the 8B shape against a float64 reference,
strides kept, no host sync, bitwise repeatable.

Tolerance: relative L2 < 4e-3 in bf16 (one rounding of a float32 rotation; transformers' own
bf16 formula, which rounds three times, is checked to be no closer to float64 than ours).
"""

from __future__ import annotations

import pytest
import torch

from trainer.kernels.rope import apply_rotary, kernel_supported, reference_rotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _inputs(T: int = 16384, H: int = 32, D: int = 128):
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, T, H, D, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
    pos = torch.randint(0, 4096, (1, T), device="cuda", generator=gen).double()
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda").double() / D))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return x.requires_grad_(), emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_bf16_forward_and_backward_against_float64() -> None:
    x, cos, sin = _inputs()
    assert kernel_supported(x, cos)
    grad = torch.randn_like(x)
    out = apply_rotary(x, cos, sin)
    (dx,) = torch.autograd.grad(out, x, grad)
    assert out.stride() == x.stride()
    x64 = x.detach().double().requires_grad_()
    ref = reference_rotary(x64, cos.double(), sin.double())
    (ref_dx,) = torch.autograd.grad(ref, x64, grad.double())
    hf = reference_rotary(x.detach(), cos, sin)
    assert _rel(out, ref) < 4e-3 and _rel(dx, ref_dx) < 4e-3
    assert _rel(out, ref) <= _rel(hf, ref) * 1.01


def test_no_host_sync_and_repeatable() -> None:
    x, cos, sin = _inputs(T=4096)
    grad = torch.randn_like(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = apply_rotary(x, cos, sin)
        (d1,) = torch.autograd.grad(first, x, grad)
        second = apply_rotary(x, cos, sin)
        (d2,) = torch.autograd.grad(second, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, second) and torch.equal(d1, d2)
