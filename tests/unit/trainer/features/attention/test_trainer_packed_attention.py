"""Packing never leaks attention across samples (the baseline path: transformers' own masks).

The loss of a packed row must equal the token-weighted loss of its samples run one by one. Tolerance:
float32 on CPU, the same kernels on the same numbers except the mask, so 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from trainer.data.dataset import Sample
from trainer.model.load import loss_sum, packed_forward
from trainer.data.packing import pack_batch
from trainer.model.tiny import build_tiny_model

LENGTHS = (
    13,
    7,
    20,
    5,
)  # longer than GPT-OSS's tiny sliding window (8), so both mask kinds are checked


def _samples(seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(ids, ids)
        for ids in (torch.randint(6, 512, (n,), generator=g).tolist() for n in LENGTHS)
    ]


def _packed_and_separate(model, samples) -> tuple[torch.Tensor, torch.Tensor]:
    batch = pack_batch(samples)
    packed = loss_sum(packed_forward(model, batch), batch.targets) / batch.num_targets
    total, count = torch.zeros(()), 0
    for s in samples:
        one = pack_batch([s])
        total = total + loss_sum(packed_forward(model, one), one.targets)
        count += one.num_targets
    return packed, total / count


CASES = [
    ("llama", "sdpa"),
    ("llama", "eager"),
    ("qwen3", "sdpa"),
    ("qwen3", "eager"),
    ("gpt_oss", "eager"),
    ("mistral", "sdpa"),
    ("gemma", "sdpa"),
    ("qwen3_moe", "sdpa"),
]


class TestPackedEqualsPerSample:
    @pytest.mark.parametrize(("arch", "attention"), CASES)
    def test_packed_loss_equals_token_weighted_per_sample_loss(self, arch, attention):
        model, _ = build_tiny_model(arch, seed=1)
        model.set_attn_implementation(attention)
        model.eval()
        with torch.no_grad():
            packed, separate = _packed_and_separate(model, _samples())
        torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)

    def test_gradients_match_too(self):
        model, _ = build_tiny_model("qwen3", seed=2)
        model.eval()
        samples = _samples(3)
        packed, _ = _packed_and_separate(model, samples)
        packed_grads = torch.autograd.grad(packed, list(model.parameters()))
        _, separate = _packed_and_separate(model, samples)
        separate_grads = torch.autograd.grad(separate, list(model.parameters()))
        for a, b in zip(packed_grads, separate_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class TestAllOnesMask:
    def test_an_all_ones_mask_would_disable_the_boundaries(self):
        """Why the trainer never passes a mask: transformers then treats the row as one sequence."""
        model, _ = build_tiny_model("llama", seed=1)
        model.eval()
        samples = _samples()
        batch = pack_batch(samples)
        with torch.no_grad():
            _, separate = _packed_and_separate(model, samples)
            logits = model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=torch.ones_like(batch.input_ids),
                use_cache=False,
            ).logits
            leaky = loss_sum(logits, batch.targets) / batch.num_targets
        assert abs(leaky.item() - separate.item()) > 1e-4

    def test_packed_forward_refuses_a_mask_or_cache(self):
        model, _ = build_tiny_model("llama", seed=1)
        batch = pack_batch(_samples())
        with pytest.raises(
            ValueError, match="attention_mask must not be passed with packed rows"
        ):
            packed_forward(
                model, batch, attention_mask=torch.ones_like(batch.input_ids)
            )
        with pytest.raises(ValueError, match="past_key_values"):
            packed_forward(model, batch, past_key_values=None)


class TestSharedPrefixesAndWindows:
    """A shared prefix is seen whole: models whose attention may get a sliding window pack whole
    sequences (``windowed_attention``), and a prefixed batch reaching a windowed layer is refused."""

    def test_windowed_attention_finds_per_layer_and_config_windows(self) -> None:
        from transformers import (GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, Phi3Config,
                                  Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

        from trainer.features.attention.packed import windowed_attention

        kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=40000)
        # Phi-3 reads the config's window in every layer (no per-layer attribute, no layer types)
        assert windowed_attention(Phi3ForCausalLM(Phi3Config(sliding_window=6, **kw)))
        assert not windowed_attention(Phi3ForCausalLM(Phi3Config(sliding_window=None, **kw)))
        # Phi-3-mini-128k's window (262,143) is longer than its positions: it never binds
        assert not windowed_attention(Phi3ForCausalLM(Phi3Config(sliding_window=262143, max_position_embeddings=131072,
                                                                  **kw)))
        assert windowed_attention(GptOssForCausalLM(GptOssConfig(head_dim=8, num_local_experts=2,
                                                                 num_experts_per_tok=1, **kw)))
        assert not windowed_attention(LlamaForCausalLM(LlamaConfig(**kw)))
        assert not windowed_attention(Qwen3ForCausalLM(Qwen3Config(head_dim=8, **kw)))  # full layers only

    def test_a_prefixed_batch_at_a_windowed_layer_is_refused(self) -> None:
        from trainer.data.packed_metadata import build_packed_metadata
        from trainer.features.attention.packed import packed_attention_forward

        meta = build_packed_metadata([3, 2, 2], "cpu", prefixes=[-1, 0, 0])
        q = torch.randn(1, 4, 7, 8)
        with pytest.raises(ValueError, match="sliding-window layer"):
            packed_attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=4, packed_metadata=meta)
        # a window no shorter than the row never binds: attended as without one
        out, _ = packed_attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=7, packed_metadata=meta)
        expected, _ = packed_attention_forward(torch.nn.Module(), q, q, q, None, packed_metadata=meta)
        assert torch.equal(out, expected)

    @pytest.mark.parametrize(("backend", "cache", "takes"), [
        ("sdpa", True, True), ("sdpa", False, False), ("triton", True, True),
        ("torch_varlen", True, False),  # varlen_attn has no prefix; the Triton kernel it falls to needs CUDA
    ])
    def test_which_installed_attention_takes_prefixes(self, backend, cache, takes) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from trainer.features.attention.feature import PackedAttentionHandle

        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=40000))
        handle = PackedAttentionHandle(model, backend, cache)
        try:
            assert handle.takes_prefixes is takes
        finally:
            handle.remove()
