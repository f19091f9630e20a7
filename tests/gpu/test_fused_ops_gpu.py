"""Fused RMSNorm / SwiGLU Triton kernels on a GPU, and ``trainer.features.fused_ops.patch`` in a LoRA step.

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_fused_ops_gpu.py``. Skipped without
CUDA. Inputs are fresh random draws (never zeros or ones). Errors are relative L2,
``||x - ref|| / ||ref||``, against a float64 reference of the same formula; "exact" is the
fraction of elements bit-equal to torch's eager code in the same dtype on the same GPU.

Tolerances:
- vs float64: 1e-2 for bf16 results (one bf16 rounding is ~2e-3 relative L2), 2e-3 for fp16,
  1e-5 for fp32; and never more than 1.5x eager's own error against the same reference.
- vs eager, forward and SwiGLU backward, 16-bit inputs: at least 99% bit-equal. The kernels round where eager
  rounds, so only a last-ulp difference in ``exp``/``rsqrt`` or the sum order next to a rounding
  tie can flip an element; rounding at a different step flips ~25%. The RMSNorm backward is not
  compared bit for bit: eager rounds ``dy * w`` to bf16 before the fp32 reduction, the kernel
  does not.
- the LoRA step (8-layer Llama and Qwen3, hidden 1024, head dim 128, bf16 weights, bf16
  autocast, non-reentrant checkpointing or ``trainer.features.offload``'s offloaded checkpointing): loss and every LoRA gradient within relative L2 2e-2
  of the unpatched model's (bf16 rounding differences through 8 layers of backward land near
  1e-3 to 5e-3).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.features.fused_ops import patch as fused_ops
from trainer.config import LoraConfig
from trainer.kernels import rmsnorm, swiglu
from trainer.kernels.rmsnorm import GEMMA, GPT_OSS, LLAMA
from trainer.model.load import apply_lora
from trainer.features.offload import ActivationOffloader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REL_L2 = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
NO_WORSE_THAN_EAGER = 1.5
EXACT = 0.99
STEP_REL_L2 = 2e-2


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
    ).item()


def _exact(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).double().mean().item()


def _check(
    name: str, got: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, tol: float
) -> None:
    err, eager_err = _rel_l2(got, ref), _rel_l2(eager, ref)
    assert err < tol, f"{name}: relative L2 {err:.2e} vs float64 (limit {tol:.0e})"
    # the 1e-6 floor only matters for fp32, where both sit near 1e-7 and sum order decides
    assert err <= NO_WORSE_THAN_EAGER * eager_err + 1e-6, (
        f"{name}: {err:.2e} vs eager's {eager_err:.2e}"
    )


# (rows, H, x dtype, weight dtype, variant)
NORM_CASES = [
    (16384, 4096, torch.bfloat16, torch.bfloat16, LLAMA),
    (
        16384 * 32,
        128,
        torch.bfloat16,
        torch.bfloat16,
        LLAMA,
    ),  # Qwen3 q_norm: 16k tokens x 32 heads
    (4096, 8192, torch.bfloat16, torch.bfloat16, LLAMA),
    (
        16384,
        4096,
        torch.bfloat16,
        torch.float32,
        LLAMA,
    ),  # fp32 weight, bf16 activations: fp32 out
    (16384, 4096, torch.float16, torch.float16, LLAMA),
    (16384, 4096, torch.float32, torch.float32, LLAMA),
    (16384, 2880, torch.bfloat16, torch.bfloat16, GPT_OSS),
    (16384, 4096, torch.bfloat16, torch.bfloat16, GEMMA),
    (3001, 1000, torch.bfloat16, torch.bfloat16, LLAMA),
    (777, 129, torch.bfloat16, torch.bfloat16, GEMMA),
]


def _norm_inputs(rows, H, x_dtype, w_dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, H, device="cuda", generator=gen) * 3).to(x_dtype)
    w = (torch.randn(H, device="cuda", generator=gen) * 0.5 + 1).to(w_dtype)
    return x, w, gen


class TestRMSNormKernel:
    @pytest.mark.parametrize(
        "case", NORM_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-w{c[3]}-{c[4].name}"
    )
    def test_matches_float64_and_rounds_like_eager(self, case):
        rows, H, x_dtype, w_dtype, variant = case
        x, w, gen = _norm_inputs(rows, H, x_dtype, w_dtype)
        xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rmsnorm.rms_norm_triton(xk, wk, 1e-5, variant)
        dy = torch.randn(y.shape, device="cuda", generator=gen).to(y.dtype)
        y.backward(dy)
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        eager = rmsnorm.rms_norm_torch(xe, we, 1e-5, variant)
        eager.backward(dy)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        ref = rmsnorm.rms_norm_torch(x64, w64, 1e-5, variant)
        ref.backward(dy.double())

        assert y.dtype == eager.dtype
        coarse = max(
            REL_L2[x_dtype], REL_L2[y.dtype]
        )  # Llama rounds x_hat to x's dtype first
        _check("y", y, eager, ref, coarse)
        _check("dx", xk.grad, xe.grad, x64.grad, REL_L2[x_dtype])
        _check(
            "dweight", wk.grad, we.grad, w64.grad, max(REL_L2[x_dtype], REL_L2[w_dtype])
        )
        if (
            x_dtype != torch.float32
        ):  # fp32 rows: sum order alone flips last bits, nothing to round
            assert _exact(y, eager) >= EXACT

    def test_frozen_weight_gets_no_gradient(self):
        x, w, _ = _norm_inputs(1024, 4096, torch.bfloat16, torch.bfloat16)
        x.requires_grad_()
        rmsnorm.rms_norm_triton(x, w, 1e-5, LLAMA).sum().backward()
        assert w.grad is None and x.grad is not None and torch.isfinite(x.grad).all()

    def test_same_bits_twice(self):
        """dweight comes from per-program partial rows and one torch.sum: no atomics, same bits."""
        x, w, gen = _norm_inputs(16384, 4096, torch.bfloat16, torch.bfloat16, seed=1)
        dy = torch.randn(16384, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        runs = []
        for _ in range(2):
            xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = rmsnorm.rms_norm_triton(xk, wk, 1e-5, LLAMA)
            y.backward(dy)
            runs.append((y, xk.grad, wk.grad))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


class TestSwiGLUKernel:
    @pytest.mark.parametrize(
        ("shape", "dtype"),
        [
            ((16384, 14336), torch.bfloat16),
            ((4096, 14336), torch.float16),
            ((4096, 14336), torch.float32),
            ((3, 1001, 77), torch.bfloat16),
        ],
    )
    def test_matches_float64_and_rounds_like_eager(self, shape, dtype):
        gen = torch.Generator(device="cuda").manual_seed(0)
        g = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype)
        u = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dtype)
        dy = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        gk, uk = g.clone().requires_grad_(), u.clone().requires_grad_()
        y = swiglu.swiglu_triton(gk, uk)
        y.backward(dy)
        ge, ue = g.clone().requires_grad_(), u.clone().requires_grad_()
        eager = swiglu.swiglu_torch(ge, ue)
        eager.backward(dy)
        results = [(y, eager), (gk.grad, ge.grad), (uk.grad, ue.grad)]
        del gk, uk, ge, ue
        g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
        ref = swiglu.swiglu_torch(g64, u64)
        ref.backward(dy.double())
        refs = [ref.detach(), g64.grad, u64.grad]
        for name, (got, want), r in zip(("y", "dgate", "dup"), results, refs):
            _check(name, got, want, r, REL_L2[dtype])
            if (
                dtype != torch.float32
            ):  # fp32: last-ulp ``exp`` differences show, nothing is rounded
                assert _exact(got, want) >= EXACT, name

    def test_same_bits_twice(self):
        gen = torch.Generator(device="cuda").manual_seed(2)
        g, u, dy = (
            torch.randn(16384, 14336, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(3)
        )
        runs = []
        for _ in range(2):
            gk, uk = g.clone().requires_grad_(), u.clone().requires_grad_()
            y = swiglu.swiglu_triton(gk, uk)
            y.backward(dy)
            runs.append((y, gk.grad, uk.grad))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


def _small_model(arch: str, checkpointing: str) -> nn.Module:
    """8 layers, hidden 1024, 8 heads of 128 (2 KV heads), bf16 on CUDA, LoRA on q,k,v,o,gate,up,down.

    ``checkpointing``: ``hf`` (transformers' non-reentrant checkpointing, as ``trainer.model.load``
    enables it) or ``offload`` (``trainer.features.offload.ActivationOffloader`` on the decoder layers).
    """
    import transformers

    common = {
        "vocab_size": 2048,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    config = (
        transformers.LlamaConfig(**common)
        if arch == "llama"
        else transformers.Qwen3Config(**common)
    )
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(0)
        model = (
            transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            .cuda()
            .train()
        )
        with (
            torch.no_grad()
        ):  # HF starts norm weights at 1: give them the spread of a trained model
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.3)
        if checkpointing == "hf":
            kwargs = {"use_reentrant": False}
            if hasattr(
                model, "activation_checkpointing_enable"
            ):  # transformers >= 5.2x
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs=kwargs
                )
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs=kwargs
                )
        model = apply_lora(model, LoraConfig(r=16, alpha=32))
        if checkpointing == "offload":
            ActivationOffloader("cuda").apply(model)
        for name, p in model.named_parameters():
            if (
                "lora_B" in name
            ):  # peft starts B at zero, which would make every dA zero
                p.data = torch.randn_like(p) * 0.02
    return model


def _step(
    model: nn.Module, ids: torch.Tensor, autocast: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach().float(), {
        n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad
    }


class TestLoraStep:
    @pytest.mark.parametrize(
        ("arch", "checkpointing"),
        [("llama", "hf"), ("qwen3", "hf"), ("llama", "offload")],
    )
    def test_loss_and_lora_grads_close_with_and_without_install(
        self, arch, checkpointing, monkeypatch
    ):
        model = _small_model(arch, checkpointing)
        ids = torch.randint(
            0,
            2048,
            (2, 2048),
            device="cuda",
            generator=torch.Generator("cuda").manual_seed(0),
        )
        # float32 reference: the same weights upcast (bf16 values are exact in fp32), no autocast;
        # the adapters are fp32 already and are put back untouched.
        adapters = {n: p.data.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.float()
        loss_exact, exact = _step(model, ids, autocast=False)
        model.to(torch.bfloat16)
        for n, p in model.named_parameters():
            if n in adapters:
                p.data = adapters[n]
        loss0, grads0 = _step(model, ids)

        calls = {"norm": 0, "swiglu": 0}
        norm_kernel, swiglu_kernel = rmsnorm.rms_norm_triton, swiglu.swiglu_triton

        def counted_norm(*args):
            calls["norm"] += 1
            return norm_kernel(*args)

        def counted_swiglu(*args):
            calls["swiglu"] += 1
            return swiglu_kernel(*args)

        monkeypatch.setattr(rmsnorm, "rms_norm_triton", counted_norm)
        monkeypatch.setattr(swiglu, "swiglu_triton", counted_swiglu)
        result = fused_ops.install(model)
        assert result.triton, result.describe()
        assert len(result.mlps) == 8 and len(result.norms) == (
            17 if arch == "llama" else 33
        )
        loss1, grads1 = _step(model, ids)
        # forward + recompute in backward: every norm but the final one twice, every MLP twice
        assert calls == {"norm": 2 * len(result.norms) - 1, "swiglu": 16}

        try:
            assert (
                torch.isfinite(loss1)
                and abs(loss1.item() - loss0.item()) / abs(loss0.item()) < STEP_REL_L2
            )
            # Both bf16 runs round differently (the kernels round once in float32 where eager rounds
            # each bf16 op), so each is held against the float32 result: the fused one may be at
            # most NO_WORSE_THAN_EAGER x as far from it as eager (floor STEP_REL_L2 / 2). The two
            # bf16 runs then differ by at most the sum of their errors; 0.1 is a sanity bound.
            for n in grads0:
                eager_err = _rel_l2(grads0[n], exact[n])
                assert _rel_l2(grads1[n], exact[n]) <= max(NO_WORSE_THAN_EAGER * eager_err, STEP_REL_L2 / 2), n
                assert _rel_l2(grads1[n], grads0[n]) < 0.1, n
            assert abs(loss1 - loss_exact) <= max(NO_WORSE_THAN_EAGER * abs(loss0 - loss_exact), 1e-3 * loss_exact)
        finally:
            result.uninstall()  # the RoPE patch is module-wide: do not leak it into later tests
