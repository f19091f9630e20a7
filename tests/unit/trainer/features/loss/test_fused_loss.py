"""Fused chunked linear + cross-entropy against ``F.cross_entropy`` on the full logits.

Tolerances (max abs error relative to the reference's largest magnitude):
- fp32: loss rtol 1e-6, gradients 1e-5 (only summation order differs).
- bf16: the reference also rounds the logits to bf16 once and upcasts (what stock transformers
  does); gradients are cast to bf16 before the two gradient matmuls in both, so loss rtol 1e-4,
  gradients 2e-2 (a few bf16 ulps).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.features.loss.fused import (
    causal_lm_loss,
    default_chunk_size,
    fused_linear_cross_entropy,
    supported,
)

pytestmark = pytest.mark.usefixtures("one_thread")


TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-4, 2e-2)}


def _inputs(
    dtype: torch.dtype, n: int = 37, hidden: int = 32, vocab: int = 301, seed: int = 0
):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::4] = -100
    return h, w, y


def _reference(h, w, y, softcap=None, reduction="mean"):
    logits = (h @ w.T).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, y, ignore_index=-100, reduction=reduction)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class TestAgainstFullLogits:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(
        "chunk_size", [5, 16, 1000]
    )  # 37 tokens: ragged last chunk, one chunk
    @pytest.mark.parametrize("softcap", [None, 4.0])
    def test_loss_and_grads_match(self, dtype, chunk_size, softcap) -> None:
        loss_tol, grad_tol = TOLERANCES[dtype]
        h, w, y = _inputs(dtype)
        loss = fused_linear_cross_entropy(
            h, w, y, chunk_size=chunk_size, softcap=softcap
        )
        grad_h, grad_w = torch.autograd.grad(loss, (h, w))
        ref = _reference(h, w, y, softcap)
        ref_h, ref_w = torch.autograd.grad(ref, (h, w))
        assert loss.dtype == torch.float32
        assert loss.item() == pytest.approx(ref.item(), rel=loss_tol)
        assert grad_h.dtype == dtype and grad_w.dtype == dtype
        assert _rel(grad_h, ref_h) < grad_tol
        assert _rel(grad_w, ref_w) < grad_tol

    def test_ignored_tokens_contribute_nothing(self) -> None:
        h, w, y = _inputs(torch.float32)
        loss = fused_linear_cross_entropy(h, w, y, chunk_size=8)
        (grad_h,) = torch.autograd.grad(loss, h)
        assert torch.count_nonzero(grad_h[y == -100]) == 0
        h2 = h.detach().clone()
        h2[y == -100] += 100.0  # whatever sits at an ignored position
        assert fused_linear_cross_entropy(
            h2, w, y, chunk_size=8
        ).item() == pytest.approx(loss.item(), rel=1e-6)

    def test_all_ignored_gives_zero_loss_not_nan(self) -> None:
        h, w, _ = _inputs(torch.float32)
        y = torch.full((h.shape[0],), -100)
        loss = fused_linear_cross_entropy(h, w, y)
        assert loss.item() == 0.0
        (grad_h,) = torch.autograd.grad(loss, h)
        assert torch.count_nonzero(grad_h) == 0

    def test_batched_shapes_are_flattened(self) -> None:
        h, w, y = _inputs(torch.float32, n=36)
        loss = fused_linear_cross_entropy(
            h.view(2, 18, -1), w, y.view(2, 18), chunk_size=7
        )
        assert loss.item() == pytest.approx(_reference(h, w, y).item(), rel=1e-6)


class TestGradientAccumulation:
    def test_num_items_makes_micro_batches_sum_to_the_whole_batch(self) -> None:
        h, w, y = _inputs(torch.float32, n=40)
        whole = fused_linear_cross_entropy(h, w, y)
        whole_h, whole_w = torch.autograd.grad(whole, (h, w))
        num_items = int((y != -100).sum())
        parts = [
            fused_linear_cross_entropy(h[s], w, y[s], num_items=num_items, chunk_size=6)
            for s in (slice(0, 13), slice(13, 40))
        ]
        total = parts[0] + parts[1]
        acc_h, acc_w = torch.autograd.grad(total, (h, w))
        assert total.item() == pytest.approx(whole.item(), rel=1e-6)
        assert _rel(acc_h, whole_h) < 1e-5 and _rel(acc_w, whole_w) < 1e-5
        assert total.item() == pytest.approx(
            _reference(h, w, y, reduction="sum").item() / num_items, rel=1e-6
        )

    def test_num_items_may_be_a_device_tensor(self) -> None:
        h, w, y = _inputs(torch.float32)
        count = (y != -100).sum()
        assert fused_linear_cross_entropy(
            h, w, y, num_items=count
        ).item() == pytest.approx(_reference(h, w, y).item(), rel=1e-6)


class TestWhatIsComputed:
    def test_frozen_head_gets_no_weight_gradient(self) -> None:
        h, w, y = _inputs(torch.float32)
        w = w.detach()
        loss = fused_linear_cross_entropy(h, w, y)
        loss.backward()
        assert w.grad is None and h.grad is not None

    def test_without_grad_it_only_computes_the_loss(self) -> None:
        h, w, y = _inputs(torch.float32)
        with torch.no_grad():
            loss = fused_linear_cross_entropy(h, w, y, chunk_size=4)
        assert not loss.requires_grad
        assert loss.item() == pytest.approx(_reference(h, w, y).item(), rel=1e-6)

    def test_upstream_gradient_scales_the_result(self) -> None:
        h, w, y = _inputs(torch.float32)
        (g1,) = torch.autograd.grad(fused_linear_cross_entropy(h, w, y), h)
        (g3,) = torch.autograd.grad(3.0 * fused_linear_cross_entropy(h, w, y), h)
        assert torch.allclose(g3, 3.0 * g1, rtol=1e-6)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"num_items": 0}, "num_items"),
            ({"chunk_size": -1}, "chunk_size"),
        ],
    )
    def test_bad_arguments_say_what_to_fix(self, kwargs, message) -> None:
        h, w, y = _inputs(torch.float32)
        with pytest.raises(ValueError, match=message):
            fused_linear_cross_entropy(h, w, y, **kwargs)

    def test_mismatched_inputs_are_refused(self) -> None:
        h, w, y = _inputs(torch.float32)
        with pytest.raises(ValueError, match="labels shape"):
            fused_linear_cross_entropy(h, w, y[:-1])
        with pytest.raises(ValueError, match="dtype"):
            fused_linear_cross_entropy(h, w.to(torch.bfloat16), y)
        with pytest.raises(ValueError, match="weight must be"):
            fused_linear_cross_entropy(h, w[:, :-1], y)

    def test_default_chunk_size_keeps_chunk_logits_near_256_mib(self) -> None:
        assert (
            default_chunk_size(128_256) == 512
        )  # Llama 3: 256 MiB / (4 B x 128,256) = 523 -> 512
        assert default_chunk_size(151_936) == 256  # Qwen 3
        for vocab in (32_000, 128_256, 151_936, 262_144):
            chunk = default_chunk_size(vocab)
            assert chunk & (chunk - 1) == 0
            assert 64 * 2**20 < chunk * vocab * 4 <= 256 * 2**20
        assert default_chunk_size(100) == 8192


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=256,
            tie_word_embeddings=tie,
        )
    )


class TestWithHFModels:
    @pytest.mark.parametrize("tie", [False, True])
    def test_equals_the_model_loss_and_head_gradient(self, tie: bool) -> None:
        model = _llama(tie)
        ids = torch.randint(0, 256, (1, 12))
        ref = model(input_ids=ids, labels=ids, use_cache=False).loss
        ref.backward()
        ref_grad = model.get_output_embeddings().weight.grad.clone()
        model.zero_grad()
        targets = torch.cat(
            [ids[:, 1:], torch.full((1, 1), -100)], dim=1
        )  # HF shifts inside; we pass shifted
        loss = causal_lm_loss(model, ids, targets, chunk_size=5)
        loss.backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
        assert _rel(model.get_output_embeddings().weight.grad, ref_grad) < 1e-4
        if tie:
            assert (
                model.get_output_embeddings().weight
                is model.get_input_embeddings().weight
            )

    def test_gemma2_final_logit_softcapping_is_applied(self) -> None:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        torch.manual_seed(0)
        config = Gemma2Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=256,
            final_logit_softcapping=0.5,
        )
        config._attn_implementation_internal = "eager"
        model = Gemma2ForCausalLM(config)
        ids = torch.randint(0, 256, (1, 10))
        ref = model(input_ids=ids, labels=ids, use_cache=False).loss
        targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        assert causal_lm_loss(model, ids, targets).item() == pytest.approx(
            ref.item(), rel=1e-5
        )

    @pytest.mark.filterwarnings(
        "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
    )
    def test_works_through_peft_and_refuses_an_adapted_head(self) -> None:
        import peft

        model = peft.get_peft_model(
            _llama(False), peft.LoraConfig(r=4, target_modules="all-linear")
        )
        assert supported(model) is None
        ids = torch.randint(0, 256, (1, 8))
        targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        causal_lm_loss(model, ids, targets).backward()
        assert any(
            p.grad is not None for n, p in model.named_parameters() if "lora_" in n
        )
        adapted = peft.get_peft_model(
            _llama(False), peft.LoraConfig(r=4, target_modules=["lm_head"])
        )
        assert "not a plain Linear" in supported(adapted)
        with pytest.raises(ValueError, match="not a plain Linear"):
            causal_lm_loss(adapted, ids, targets)

    def test_refuses_a_head_with_bias_and_scaled_logits(self) -> None:
        model = _llama(False)
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(256))
        assert "bias" in supported(model)
        model = _llama(False)
        model.config.logit_scale = 0.5
        assert "scales its logits" in supported(model)
