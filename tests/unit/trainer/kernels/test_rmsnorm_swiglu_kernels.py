"""Fused RMSNorm / SwiGLU kernels (``trainer.kernels.rmsnorm``, ``trainer.kernels.swiglu``).

- The torch forms against transformers' own RMSNorm classes: bit for bit, forward and grads.
- The Triton kernels on CPU under ``TRITON_INTERPRET=1`` in a child process (the interpreter is
  chosen when kernels are decorated, at import), against float64 references, forward and
  backward, odd ``H`` and row counts, and the whole install on the tiny models. Triton 3.6's
  interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even; the child
  makes it round as the GPU does (``_round_bf16_like_the_gpu``), so the bit-level checks
  against eager hold for bf16 as for fp16. tests/gpu/test_fused_ops_gpu.py runs them on CUDA.

Installing them on models with the torch forms (what a CPU run takes): ``test_fused_ops_install.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_helpers import lora_model, loss_and_grads, random_ids, rel_l2

from trainer.features.fused_ops import patch as fused_ops
from trainer.kernels import rmsnorm
from trainer.kernels.rmsnorm import GEMMA, GPT_OSS, LLAMA, Variant

REPO_ROOT = Path(__file__).resolve().parents[4]
HAS_TRITON = importlib.util.find_spec("triton") is not None
ARCHS = ("llama", "qwen3", "mistral")


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------
# Torch forms
# --------------------------------------------------------------------------------------------


def _hf_norm(variant: Variant, H: int, w_dtype: torch.dtype) -> nn.Module:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cls = {"llama": LlamaRMSNorm, "gpt_oss": GptOssRMSNorm, "gemma": GemmaRMSNorm}[
        variant.name
    ]
    module = cls(H, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(
            torch.randn(H, generator=torch.Generator().manual_seed(3)) * 0.5 + 1.0
        )
    return module.to(w_dtype)


class TestTorchForms:
    @pytest.mark.parametrize("variant", [LLAMA, GPT_OSS, GEMMA], ids=lambda v: v.name)
    @pytest.mark.parametrize(
        ("x_dtype", "w_dtype"),
        [
            (torch.bfloat16, torch.bfloat16),
            (torch.bfloat16, torch.float32),
            (torch.float32, torch.bfloat16),
            (torch.float16, torch.float32),
            (torch.float32, torch.float32),
        ],
    )
    def test_rms_norm_torch_is_the_hf_forward_bit_for_bit(
        self, variant, x_dtype, w_dtype
    ):
        module = _hf_norm(variant, 129, w_dtype)
        x = (torch.randn(5, 3, 129) * 4).to(x_dtype)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = module(x1)
        got = rmsnorm.rms_norm_torch(
            x2,
            module.weight,
            module.variance_epsilon
            if hasattr(module, "variance_epsilon")
            else module.eps,
            variant,
        )
        assert got.dtype == want.dtype == variant.output_dtype(x_dtype, w_dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        dy = torch.randn_like(want)
        want.backward(dy)
        got.backward(dy)
        torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)

    def test_variants_differ_where_they_round_differently(self):
        """The three formulas are not the same function: each install check can tell them apart."""
        w = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(
            torch.bfloat16
        )
        x = torch.randn(8, 64).to(torch.bfloat16)
        llama, gpt_oss, gemma = (
            rmsnorm.rms_norm_torch(x, w, 1e-6, v) for v in (LLAMA, GPT_OSS, GEMMA)
        )
        assert not torch.equal(llama, gpt_oss)
        assert not torch.equal(gpt_oss, gemma)


class TestKernelChecks:
    def test_supported_names_a_reason_on_this_box(self):
        reason = rmsnorm.supported("cpu")
        assert reason is not None and ("Triton" in reason or "CUDA" in reason)

    def test_can_use_kernel_refuses_rows_longer_than_max_h(self):
        H = rmsnorm.MAX_H + 1
        assert not rmsnorm.can_use_kernel(torch.zeros(2, H), torch.zeros(H))
        assert not rmsnorm.can_use_kernel(torch.zeros(2, 8).double(), torch.zeros(8))
        assert not rmsnorm.can_use_kernel(torch.zeros(2, 8), torch.zeros(9))


# --------------------------------------------------------------------------------------------
# Triton kernels in the interpreter (child process)
# --------------------------------------------------------------------------------------------

# (rows, H, x dtype, weight dtype, variant, weight needs grad)
NORM_CASES = [
    (37, 1000, "float32", "float32", "llama", True),
    (7, 129, "float32", "float32", "gemma", True),
    (1, 4096, "float32", "float32", "gpt_oss", True),
    (64, 128, "float16", "float16", "llama", True),
    (33, 129, "float16", "float32", "llama", False),
    (19, 1000, "float16", "float16", "gpt_oss", True),
    (19, 257, "float16", "float16", "gemma", True),
    (41, 129, "bfloat16", "bfloat16", "llama", True),
    (5, 1000, "bfloat16", "float32", "llama", True),
    (9, 64, "float32", "bfloat16", "llama", True),
]
# (shape, dtype, gate and up as column blocks of one wider matrix: a served model's fused gate/up)
SWIGLU_CASES = [
    ((3, 7, 129), "float32", False),
    ((1000,), "float16", False),
    ((2, 1500), "float16", False),
    ((5, 333), "bfloat16", False),
    ((2, 5, 129), "bfloat16", True),
    ((7, 300), "float32", True),
]
REL_L2 = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
"""Relative L2 error against float64 for the kernel's outputs in that dtype: fp32 lands near 1e-7,
fp16 near 3e-4, bf16 near 3e-3."""
EXACT = 0.99
"""16-bit outputs bit-equal to eager on CPU: only a sum-order or ``exp`` ulp next to a rounding
tie may flip one, so at least 99% must match; rounding once instead of twice (or twice instead
of once) flips about 25% of them. Not checked for fp32 inputs: nothing is rounded there and the
sum order alone flips last bits."""


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    helpers = Path(__file__).resolve().parents[1]  # trainer_helpers: run as a script, pytest's path is not there
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join((str(REPO_ROOT), str(helpers)))}
    proc = subprocess.run(
        [sys.executable, __file__],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.slow  # ~12 s: the Triton interpreter in a child process
class TestKernelsInInterpreter:
    @pytest.mark.parametrize("index", range(len(NORM_CASES)))
    def test_rmsnorm_forward_and_grads_match_float64(self, interpreter_results, index):
        case = NORM_CASES[index]
        res = interpreter_results["norm"][index]
        assert res["dtype"] == res["eager_dtype"]
        # Llama rounds x_hat to the input dtype and then the product to the output dtype: the
        # coarser of the two bounds the error.
        tol = max(REL_L2[case[2]], REL_L2[res["dtype"].split(".")[-1]])
        assert res["y"] < tol, res
        assert res["dx"] < REL_L2[case[2]], res
        if case[5]:
            assert res["dw"] < max(REL_L2[case[2]], REL_L2[case[3]]), res
        else:
            assert res["dw"] is None, "dweight must not be computed for a frozen weight"

    @pytest.mark.parametrize(
        "index", [i for i, c in enumerate(NORM_CASES) if c[2] != "float32"]
    )
    def test_rmsnorm_rounds_where_eager_rounds(self, interpreter_results, index):
        assert interpreter_results["norm"][index]["exact"] >= EXACT, (
            interpreter_results["norm"][index]
        )

    @pytest.mark.parametrize("index", range(len(SWIGLU_CASES)))
    def test_swiglu_forward_and_grads_match_float64(self, interpreter_results, index):
        res = interpreter_results["swiglu"][index]
        tol = REL_L2[SWIGLU_CASES[index][1]]
        assert max(res["y"], res["dgate"], res["dup"]) < tol, res
        if SWIGLU_CASES[index][1] != "float32":
            assert min(res["exact_y"], res["exact_dgate"], res["exact_dup"]) >= EXACT, (
                res
            )

    @pytest.mark.parametrize("arch", ARCHS)
    def test_install_with_kernels_gives_the_same_loss_and_lora_grads(
        self, interpreter_results, arch
    ):
        """fp32 model: the kernels compute what eager does in fp32, summed in another order (1e-5)."""
        res = interpreter_results["install"][arch]
        assert res["norms"] >= 5 and res["mlps"] == 2
        assert res["loss"] < 1e-6 and res["grads"] < 1e-5, res

    @pytest.mark.parametrize("arch", ARCHS)
    def test_install_with_kernels_under_bf16_autocast(self, interpreter_results, arch):
        """bf16 SwiGLU and bf16 q/k_norm rows (fp32 weights): eager rounds ``dy * w`` and
        ``dy * u`` products the kernels keep in fp32, so gradients differ at bf16 rounding level;
        the GPU step's bound, 2e-2."""
        res = interpreter_results["install_autocast"][arch]
        assert res["loss"] < 2e-2 and res["grads"] < 2e-2, res


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter calls ``int()`` on 1-element arrays, which numpy >= 2.4 refuses."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
        )

    interpreter._patch_lang_tensor = patched


def _round_bf16_like_the_gpu() -> None:
    """Triton 3.6's interpreter truncates fp32 -> bf16 casts; round to nearest even, as the GPU does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(
                torch.bfloat16
            )
            return interpreter.TensorHandle(
                rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar
            )
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _norm_case(rows, H, x_dtype, w_dtype, variant_name, w_grad, seed) -> dict:
    variant = {"llama": LLAMA, "gpt_oss": GPT_OSS, "gemma": GEMMA}[variant_name]
    gen = torch.Generator().manual_seed(seed)
    x = (
        (torch.randn(rows, H, generator=gen) * 3)
        .to(getattr(torch, x_dtype))
        .requires_grad_()
    )
    w = (
        (torch.randn(H, generator=gen) * 0.5 + 1)
        .to(getattr(torch, w_dtype))
        .requires_grad_(w_grad)
    )
    y = rmsnorm.rms_norm_triton(x, w, 1e-5, variant)
    dy = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(dy)
    x64, w64 = (
        x.detach().double().requires_grad_(),
        w.detach().double().requires_grad_(),
    )
    ref = rmsnorm.rms_norm_torch(x64, w64, 1e-5, variant)
    ref.backward(dy.double())
    eager = rmsnorm.rms_norm_torch(x.detach(), w.detach(), 1e-5, variant)
    return {
        "dtype": str(y.dtype),
        "eager_dtype": str(eager.dtype),
        "y": rel_l2(y, ref),
        "dx": rel_l2(x.grad, x64.grad),
        "dw": rel_l2(w.grad, w64.grad)
        if w_grad
        else (None if w.grad is None else -1.0),
        "exact": (y == eager).double().mean().item(),
    }


def _swiglu_case(shape, dtype, block, seed) -> dict:
    from trainer.kernels import swiglu

    gen = torch.Generator().manual_seed(seed)
    if block:  # gate and up: columns [0, I) and [I + 3, 2I + 3) of one matrix, read in place
        width = shape[-1]
        wide = (torch.randn(*shape[:-1], 2 * width + 3, generator=gen) * 3).to(getattr(torch, dtype)).requires_grad_()
        g, u = wide[..., :width], wide[..., width + 3:]
        assert not g.is_contiguous() and not u.is_contiguous()
    else:
        g, u = (
            (torch.randn(shape, generator=gen) * 3)
            .to(getattr(torch, dtype))
            .requires_grad_()
            for _ in range(2)
        )
    y = swiglu.swiglu_triton(g, u)
    assert y.is_contiguous()
    dy = torch.randn(shape, generator=gen).to(y.dtype)
    y.backward(dy)
    dgate, dup = (wide.grad[..., :width], wide.grad[..., width + 3:]) if block else (g.grad, u.grad)
    g64, u64 = (
        g.detach().double().requires_grad_(),
        u.detach().double().requires_grad_(),
    )
    ref = swiglu.swiglu_torch(g64, u64)
    ref.backward(dy.double())
    ge, ue = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    eager = swiglu.swiglu_torch(ge, ue)
    eager.backward(dy)
    return {
        "y": rel_l2(y, ref),
        "dgate": rel_l2(dgate, g64.grad),
        "dup": rel_l2(dup, u64.grad),
        "exact_y": (y == eager).double().mean().item(),
        "exact_dgate": (dgate == ge.grad).double().mean().item(),
        "exact_dup": (dup == ue.grad).double().mean().item(),
    }


def _install_case(arch: str, autocast: bool) -> dict:
    model = lora_model(arch)
    ids = random_ids()
    loss0, grads0 = loss_and_grads(model, ids, autocast)
    result = fused_ops.install(model, triton=True)
    loss1, grads1 = loss_and_grads(model, ids, autocast)
    return {
        "norms": len(result.norms),
        "mlps": len(result.mlps),
        "loss": rel_l2(loss1, loss0),
        "grads": max(rel_l2(grads1[n], grads0[n]) for n in grads0),
    }


def _run_interpreter_cases() -> dict:
    """Child-process body: every case through the kernels; relative errors as JSON."""
    _patch_interpreter_index()
    _round_bf16_like_the_gpu()
    torch.set_num_threads(1)
    return {
        "norm": [_norm_case(*case, seed=i) for i, case in enumerate(NORM_CASES)],
        "swiglu": [_swiglu_case(*case, seed=i) for i, case in enumerate(SWIGLU_CASES)],
        "install": {arch: _install_case(arch, autocast=False) for arch in ARCHS},
        "install_autocast": {
            arch: _install_case(arch, autocast=True) for arch in ARCHS
        },
    }


if __name__ == "__main__":
    print(json.dumps(_run_interpreter_cases()))
