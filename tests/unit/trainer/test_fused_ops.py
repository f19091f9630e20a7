"""Fused RMSNorm / SwiGLU (``trainer.kernels.rmsnorm``, ``trainer.kernels.swiglu``, ``trainer.fused_ops``).

- The torch forms against transformers' own RMSNorm classes: bit for bit, forward and grads.
- ``install`` on tiny random-weight Llama, Qwen3 and Mistral models with peft LoRA: on CPU the
  patched model takes the torch forms, so loss and LoRA gradients must be EQUAL (tolerance 0)
  to the unpatched model's, in fp32 and under bf16 autocast, with gradient checkpointing too;
  ``uninstall`` restores the classes' forwards.
- The Triton kernels on CPU under ``TRITON_INTERPRET=1`` in a child process (the interpreter is
  chosen when kernels are decorated, at import), against float64 references, forward and
  backward, odd ``H`` and row counts, and the whole install on the tiny models. Triton 3.6's
  interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even; the child
  makes it round as the GPU does (``_round_bf16_like_the_gpu``), so the bit-level checks
  against eager hold for bf16 as for fp16. tests/gpu/test_fused_ops_gpu.py runs them on CUDA.
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

from trainer import fused_ops
from trainer.config import LoraConfig
from trainer.kernels import rmsnorm
from trainer.kernels.rmsnorm import GEMMA, GPT_OSS, LLAMA, Variant
from trainer.model import apply_lora
from trainer.tiny import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[3]
HAS_TRITON = importlib.util.find_spec("triton") is not None
ARCHS = ("llama", "qwen3", "mistral")


pytestmark = pytest.mark.usefixtures("one_thread")


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
    ).item()


def _lora_model(arch: str, seed: int = 0) -> nn.Module:
    """A tiny ``arch`` with peft LoRA on q,k,v,o,gate,up,down; norm weights and LoRA B made random."""
    model, _ = build_tiny_model(arch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with (
        torch.no_grad()
    ):  # HF starts norm weights at 1 (Gemma 0): make the weight's rounding matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    model = apply_lora(model, LoraConfig(r=4, alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would make every dA zero
            p.data = torch.randn(p.shape, generator=g) * 0.05
    return model


def _loss_and_grads(
    model: nn.Module, ids: torch.Tensor, autocast: bool
) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if autocast
        else torch.autocast("cpu", enabled=False)
    )
    with ctx:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {
        n: p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    assert grads and all(g.abs().sum() > 0 for g in grads.values()), (
        "every LoRA weight must get a gradient"
    )
    return loss.detach(), grads


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(6, 500, (2, 24), generator=torch.Generator().manual_seed(seed))


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


# --------------------------------------------------------------------------------------------
# install / uninstall (CPU: the torch forms)
# --------------------------------------------------------------------------------------------


class TestInstall:
    @pytest.mark.parametrize(
        ("arch", "norms", "mlps"),
        [
            ("llama", {"LlamaRMSNorm": 5}, {"LlamaMLP": 2}),
            ("qwen3", {"Qwen3RMSNorm": 9}, {"Qwen3MLP": 2}),
            ("mistral", {"MistralRMSNorm": 5}, {"MistralMLP": 2}),
            ("gpt_oss", {"GptOssRMSNorm": 5}, {}),
            ("qwen3_moe", {"Qwen3MoeRMSNorm": 9}, {}),
            ("gemma", {"GemmaRMSNorm": 5}, {}),
        ],
    )
    def test_patches_every_recognised_module(self, arch, norms, mlps):
        """2 layers: 2 norms each + the final one; Qwen3 adds q_norm and k_norm per layer."""
        model, _ = build_tiny_model(arch)
        result = fused_ops.install(model)
        assert result.counts() == {**norms, **mlps}
        assert not result.triton and result.why_not_triton
        assert all("forward" in vars(m) for m in (*result.norms, *result.mlps))

    def test_gemma_gelu_mlp_is_left_alone_with_the_reason(self):
        model, _ = build_tiny_model("gemma")
        result = fused_ops.install(model)
        assert result.skipped == {"GemmaMLP": "act_fn is not SiLU"}
        assert "GemmaMLP (act_fn is not SiLU)" in result.describe()

    @pytest.mark.parametrize("arch", ARCHS)
    @pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
    def test_loss_and_lora_grads_equal_with_and_without_install(self, arch, autocast):
        """Tolerance 0: on CPU the patched forwards are the eager formulas op for op."""
        model = _lora_model(arch)
        ids = _ids()
        loss0, grads0 = _loss_and_grads(model, ids, autocast)
        result = fused_ops.install(model)
        assert len(result.norms) >= 5 and len(result.mlps) == 2
        loss1, grads1 = _loss_and_grads(model, ids, autocast)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        for name in grads0:
            torch.testing.assert_close(
                grads1[name], grads0[name], rtol=0, atol=0, msg=name
            )

    def test_same_under_non_reentrant_gradient_checkpointing(self):
        model = _lora_model("qwen3")
        base = model.base_model.model
        kwargs = {"use_reentrant": False}
        if hasattr(
            base, "activation_checkpointing_enable"
        ):  # transformers >= 5.2x, as trainer.model does
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert any(getattr(m, "gradient_checkpointing", False) for m in base.modules())
        ids = _ids(1)
        loss0, grads0 = _loss_and_grads(model, ids, autocast=True)
        fused_ops.install(model)
        loss1, grads1 = _loss_and_grads(model, ids, autocast=True)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        for name in grads0:
            torch.testing.assert_close(
                grads1[name], grads0[name], rtol=0, atol=0, msg=name
            )

    def test_same_under_the_offloading_checkpoint(self):
        """``trainer.offload`` wraps the decoder layers; the patched norms and MLPs sit inside them."""
        from trainer.offload import ActivationOffloader

        model = _lora_model("llama")
        offloader = ActivationOffloader("cpu")
        offloader.apply(model)
        ids = _ids(2)
        loss0, grads0 = _loss_and_grads(model, ids, autocast=True)
        result = fused_ops.install(model)
        assert len(result.norms) == 5 and len(result.mlps) == 2
        loss1, grads1 = _loss_and_grads(model, ids, autocast=True)
        offloader.remove(model)
        torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
        for name in grads0:
            torch.testing.assert_close(
                grads1[name], grads0[name], rtol=0, atol=0, msg=name
            )

    def test_uninstall_restores_the_class_forwards(self):
        model = _lora_model("qwen3")
        result = fused_ops.install(model)
        patched = [*result.norms, *result.mlps]
        result.uninstall()
        assert all(
            "forward" not in vars(m) and not hasattr(m, "_ftq_fused_ops")
            for m in patched
        )
        assert all(m.forward.__func__ is type(m).forward for m in patched)
        assert result.counts() == {}

    def test_module_level_uninstall_finds_the_patched_modules(self):
        model = _lora_model("llama")
        result = fused_ops.install(model)
        assert fused_ops.uninstall(model) == len(result.norms) + len(result.mlps) == 7
        assert fused_ops.uninstall(model) == 0

    def test_install_twice_patches_each_module_once(self):
        model, _ = build_tiny_model("llama")
        first = fused_ops.install(model)
        second = fused_ops.install(model)
        assert second.counts() == first.counts()
        assert fused_ops.uninstall(model) == 7

    def test_a_norm_whose_forward_differs_from_its_variant_is_left_alone(
        self, monkeypatch
    ):
        """The install check runs the module's own forward: a wrong table entry cannot slip through."""
        monkeypatch.setitem(fused_ops.NORM_VARIANTS, "LlamaRMSNorm", GPT_OSS)
        model = _lora_model("llama")
        result = fused_ops.install(model)
        assert result.norms == []
        assert (
            "differs from the gpt_oss RMSNorm formula" in result.skipped["LlamaRMSNorm"]
        )

    def test_an_unknown_rmsnorm_class_is_left_alone(self):
        class FancyRMSNorm(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.ones(8))
                self.eps = 1e-6

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * self.weight

        result = fused_ops.install(nn.Sequential(FancyRMSNorm()))
        assert result.skipped == {"FancyRMSNorm": "not a known RMSNorm formula"}

    def test_an_mlp_with_another_forward_is_left_alone(self):
        class GatedMLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
                self.down_proj, self.act_fn = nn.Linear(16, 8), nn.SiLU()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

        result = fused_ops.install(nn.Sequential(GatedMLP()))
        assert result.mlps == [] and "forward is not" in result.skipped["GatedMLP"]

    def test_mlp_forward_matched_by_syntax_not_names(self):
        """A differently named argument, annotations and a docstring still match the Llama form."""

        class MyMLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
                self.down_proj, self.act_fn = nn.Linear(16, 8), nn.SiLU()

            def forward(self, hidden: torch.Tensor) -> torch.Tensor:
                """Docstring."""
                return self.down_proj(
                    self.act_fn(self.gate_proj(hidden)) * self.up_proj(hidden)
                )

        mlp = MyMLP()
        x = torch.randn(3, 8)
        want = mlp(x)
        result = fused_ops.install(mlp)
        assert result.mlps == [mlp]
        torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)

    def test_triton_true_without_triton_is_refused(self, monkeypatch):
        monkeypatch.setattr(rmsnorm, "triton", None)
        model, _ = build_tiny_model("llama")
        with pytest.raises(ValueError, match="Triton is not installed"):
            fused_ops.install(model, triton=True)

    def test_describe_names_counts_and_backend(self):
        model, _ = build_tiny_model("llama")
        line = fused_ops.install(model, triton=False).describe()
        assert line == (
            "5 RMSNorm + 2 SwiGLU MLP modules fused (LlamaMLP 2, LlamaRMSNorm 5), "
            "RoPE kernel in 0 modeling files, torch form (triton=False)"
        )


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
# (shape, dtype)
SWIGLU_CASES = [
    ((3, 7, 129), "float32"),
    ((1000,), "float16"),
    ((2, 1500), "float16"),
    ((5, 333), "bfloat16"),
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
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
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
        "y": _rel_l2(y, ref),
        "dx": _rel_l2(x.grad, x64.grad),
        "dw": _rel_l2(w.grad, w64.grad)
        if w_grad
        else (None if w.grad is None else -1.0),
        "exact": (y == eager).double().mean().item(),
    }


def _swiglu_case(shape, dtype, seed) -> dict:
    from trainer.kernels import swiglu

    gen = torch.Generator().manual_seed(seed)
    g, u = (
        (torch.randn(shape, generator=gen) * 3)
        .to(getattr(torch, dtype))
        .requires_grad_()
        for _ in range(2)
    )
    y = swiglu.swiglu_triton(g, u)
    dy = torch.randn(shape, generator=gen).to(y.dtype)
    y.backward(dy)
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
        "y": _rel_l2(y, ref),
        "dgate": _rel_l2(g.grad, g64.grad),
        "dup": _rel_l2(u.grad, u64.grad),
        "exact_y": (y == eager).double().mean().item(),
        "exact_dgate": (g.grad == ge.grad).double().mean().item(),
        "exact_dup": (u.grad == ue.grad).double().mean().item(),
    }


def _install_case(arch: str, autocast: bool) -> dict:
    model = _lora_model(arch)
    ids = _ids()
    loss0, grads0 = _loss_and_grads(model, ids, autocast)
    result = fused_ops.install(model, triton=True)
    loss1, grads1 = _loss_and_grads(model, ids, autocast)
    return {
        "norms": len(result.norms),
        "mlps": len(result.mlps),
        "loss": _rel_l2(loss1, loss0),
        "grads": max(_rel_l2(grads1[n], grads0[n]) for n in grads0),
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
