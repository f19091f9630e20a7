"""Packed attention in stock transformers models: equivalence, build counts, mask rejection.

Tiny random-weight models built from the transformers config classes (fp32, CPU). LoRA r=8 on
every linear layer, gradient checkpointing on (non-reentrant, transformers' default), so the
metadata must also reach the checkpoint recompute.

Tolerances: cache on vs off runs the very same ops on the very same tensors, so loss and every
LoRA gradient must be bitwise equal (``torch.equal``). Packed vs one-sample-at-a-time stock
transformers (eager attention) differ only by summation order: rtol 1e-5 on the loss (fp32).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from plan_fakes import CPU, H100

from trainer.features.attention.packed import (
    ATTN_IMPLEMENTATION,
    PackedAttention,
    model_reason,
    packed_attention_forward,
)
from trainer.features.attention.feature import backend_missing, choose
from trainer.features.attention.feature import supported as packed_attention_missing
from trainer.features.loss.fused import causal_lm_loss
from trainer.data.packed_metadata import build_packed_metadata
from trainer.plan.types import ModelFacts

# peft 0.21 reads the attribute transformers 5.2x deprecated; not ours to fix.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)

LENGTHS = (5, 3, 8, 4)
"""Samples longer and shorter than the sliding window (4) of Mistral and GPT-OSS."""
COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: with several threads (and CI's 2 busy cores) the step time is
    dominated by thread hand-offs (measured 270 ms vs 20 ms per LoRA step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**COMMON))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=4))


def _gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(**COMMON, head_dim=16))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(
        GptOssConfig(
            **COMMON,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
        )
    )
    with torch.no_grad():  # random init leaves sinks at 0; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma": _gemma,
    "gpt_oss": _gpt_oss,
}
WINDOWS = {
    "llama": {None},
    "qwen3": {None},
    "mistral": {4},
    "gemma": {None},
    "gpt_oss": {4, None},
}


def install(model: torch.nn.Module, backend: str = "sdpa", cache: bool = True) -> PackedAttention:
    """``PackedAttention(backend, cache)`` installed on ``model``."""
    attn = PackedAttention(backend, cache)
    attn.install(model)
    return attn


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]()
    model.config._attn_implementation_internal = "eager"
    return model


def _lora(model: torch.nn.Module, checkpointing: bool = True) -> torch.nn.Module:
    import peft

    torch.manual_seed(1)
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False
        ),
    )
    if checkpointing:
        _enable_checkpointing(model)
    lora.train()
    return lora


def _enable_checkpointing(model: torch.nn.Module) -> None:
    if hasattr(
        model, "activation_checkpointing_enable"
    ):  # transformers >= 5.2x renamed it
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )


def _batch(lengths=LENGTHS, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed input ids [1, T] and shifted targets (next token of the same sample, -100 at each end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (1, sum(lengths)), generator=g)
    targets = torch.full_like(ids, -100)
    start = 0
    for n in lengths:
        targets[0, start : start + n - 1] = ids[0, start + 1 : start + n]
        start += n
    return ids, targets


def _packed_loss(model, ids, targets, meta) -> torch.Tensor:
    logits = model(input_ids=ids, **meta.model_kwargs()).logits
    return F.cross_entropy(logits[0].float(), targets[0], ignore_index=-100)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    assert grads and all(g is not None for g in grads.values())
    return grads


@pytest.mark.parametrize("name", list(MODELS))
class TestPackedAttentionInStockModels:
    def test_cache_on_and_off_give_bitwise_equal_loss_and_lora_grads(
        self, name: str
    ) -> None:
        results = []
        for cache in (True, False):
            model = _lora(_model(name))
            install(model, "sdpa", cache=cache)
            ids, targets = _batch()
            meta = build_packed_metadata(LENGTHS, "cpu", cache=cache)
            loss = _packed_loss(model, ids, targets, meta)
            loss.backward()
            results.append((loss.detach(), _lora_grads(model)))
        (loss_on, grads_on), (loss_off, grads_off) = results
        assert torch.equal(loss_on, loss_off)
        assert grads_on.keys() == grads_off.keys()
        for key in grads_on:
            assert torch.equal(grads_on[key], grads_off[key]), key

    def test_packed_loss_equals_token_weighted_loss_of_samples_run_one_by_one(
        self, name: str
    ) -> None:
        model = _model(name)
        model.eval()
        ids, targets = _batch()
        with torch.no_grad():
            total, count, start, logits = 0.0, 0, 0, []
            for n in LENGTHS:  # stock transformers, eager attention, no packing
                out = model(
                    input_ids=ids[:, start : start + n],
                    labels=ids[:, start : start + n],
                )
                total += out.loss.item() * (n - 1)
                count += n - 1
                logits.append(out.logits)
                start += n
            reference, reference_logits = total / count, torch.cat(logits, dim=1)
            install(model, "sdpa", cache=True)
            meta = build_packed_metadata(LENGTHS, "cpu")
            packed = _packed_loss(model, ids, targets, meta).item()
            packed_logits = model(input_ids=ids, **meta.model_kwargs()).logits
            # not trivially so: the same row as one sequence (attention across samples) differs
            leaked_logits = model(
                input_ids=ids,
                **build_packed_metadata([sum(LENGTHS)], "cpu").model_kwargs(),
            ).logits
        assert packed == pytest.approx(reference, rel=1e-5)
        assert torch.allclose(packed_logits, reference_logits, atol=1e-5)
        assert not torch.allclose(leaked_logits, reference_logits, atol=1e-3)

    def test_builds_once_per_batch_on_and_per_layer_and_recompute_off(
        self, name: str
    ) -> None:
        model = _lora(_model(name))
        layers = model.get_base_model().config.num_hidden_layers
        attn = install(model, "sdpa", cache=True)
        ids, targets = _batch()
        for cache, expected in (
            (True, 1),
            (False, layers * 2),
        ):  # x2: forward + checkpoint recompute
            attn.cache = cache
            meta = attn.metadata(LENGTHS, "cpu")
            _packed_loss(model, ids, targets, meta).backward()
            assert meta.counter.metadata == expected
            if cache:  # one structure (plus its additive form with sinks) per window kind, each built once
                assert {key[1] for key in meta.counter.structures} == WINDOWS[name]
                assert set(meta.counter.structures.values()) == {1}
            else:
                assert meta.counter.total_structures >= expected

    def test_an_all_ones_attention_mask_is_rejected_not_silently_ignored(
        self, name: str
    ) -> None:
        model = _model(name)
        install(model, "sdpa", cache=True)
        ids, _ = _batch()
        meta = build_packed_metadata(LENGTHS, "cpu")
        with pytest.raises(ValueError, match="must not pass attention_mask"):
            model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **meta.model_kwargs(),
            )


class TestStockBaselineLeaks:
    def test_stock_sdpa_cross_attends_when_an_all_ones_mask_comes_with_packed_positions(
        self,
    ) -> None:
        """Why the rejection matters: stock transformers silently drops the packing boundaries
        when a 2D mask (even all ones) is passed, and also when ``use_cache`` is on."""
        model = _model("llama")
        model.config._attn_implementation_internal = "sdpa"
        model.eval()
        ids, _ = _batch()
        positions = build_packed_metadata(LENGTHS, "cpu").position_ids
        with torch.no_grad():
            no_mask = model(
                input_ids=ids, position_ids=positions, use_cache=False
            ).logits
            ones = model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=torch.ones_like(ids),
                use_cache=False,
            ).logits
            cached = model(
                input_ids=ids, position_ids=positions
            ).logits  # config default use_cache=True
            install(model, "sdpa", cache=True)
            ours = model(
                input_ids=ids, **build_packed_metadata(LENGTHS, "cpu").model_kwargs()
            ).logits
        assert torch.allclose(
            no_mask, ours, atol=1e-5
        )  # stock packing without a mask is right
        assert not torch.allclose(
            ones, ours, atol=1e-3
        )  # with an all-ones mask it leaks
        assert not torch.allclose(cached, ours, atol=1e-3)  # and with a KV cache


class TestPlumbing:
    def test_transformers_builds_no_mask_of_its_own(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from transformers import masking_utils

        def forbidden(*args, **kwargs):
            raise AssertionError(
                "transformers derived packed boundaries itself (a host sync per forward)"
            )

        monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", forbidden)
        for name in ("llama", "gpt_oss"):
            model = _model(name)
            install(model, "sdpa")
            ids, targets = _batch()
            _packed_loss(
                model, ids, targets, build_packed_metadata(LENGTHS, "cpu")
            ).backward()

    def test_without_packed_metadata_it_says_how_to_call_the_model(self) -> None:
        model = _model("llama")
        install(model, "sdpa")
        ids, _ = _batch()
        with pytest.raises(ValueError, match="model_kwargs"):
            model(input_ids=ids)

    def test_uninstall_restores_the_previous_implementation(self) -> None:
        model = _model("llama")
        attn = install(model, "sdpa")
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        attn.uninstall()
        assert model.config._attn_implementation == "eager"
        ids, _ = _batch()
        model(
            input_ids=ids, attention_mask=torch.ones_like(ids)
        )  # the hook is gone too

    @pytest.mark.filterwarnings(
        "ignore:flex_attention called without torch.compile:UserWarning"
    )
    def test_flex_backend_matches_sdpa_on_cpu_without_grad(self) -> None:
        pytest.importorskip("torch.nn.attention.flex_attention")
        model = _model("mistral")
        model.eval()
        ids, targets = _batch(lengths=(40, 25, 70))
        losses = {}
        with torch.no_grad():
            for backend in ("sdpa", "flex"):
                attn = install(model, backend)
                losses[backend] = _packed_loss(
                    model, ids, targets, attn.metadata((40, 25, 70), "cpu")
                ).item()
                attn.uninstall()
        assert losses["flex"] == pytest.approx(losses["sdpa"], rel=1e-5)

    def test_direct_call_checks_shapes_and_dropout(self) -> None:
        class Module(torch.nn.Module):
            is_causal = True

        meta = build_packed_metadata([3, 2], "cpu")
        q = torch.randn(1, 4, 5, 8)
        kv = torch.randn(1, 2, 5, 8)
        out, weights = packed_attention_forward(
            Module(), q, kv, kv, None, packed_metadata=meta
        )
        assert out.shape == (1, 5, 4, 8) and weights is None
        with pytest.raises(ValueError, match="one packed row of 5 tokens"):
            packed_attention_forward(
                Module(),
                q[:, :, :4],
                kv[:, :, :4],
                kv[:, :, :4],
                None,
                packed_metadata=meta,
            )
        with pytest.raises(ValueError, match="softcap"):
            packed_attention_forward(
                Module(), q, kv, kv, None, softcap=30.0, packed_metadata=meta
            )
        flex_meta = build_packed_metadata([3, 2], "cpu", backend="flex")
        with pytest.raises(ValueError, match="dropout"):
            packed_attention_forward(
                Module(), q, kv, kv, None, dropout=0.1, packed_metadata=flex_meta
            )


LLAMA_FACTS = ModelFacts("llama", head_dim=128, grouped_query=True)


class TestBackendMissing:
    def test_cpu_runs_sdpa_and_says_why_not_the_gpu_kernels(self) -> None:
        assert backend_missing("sdpa", CPU, LLAMA_FACTS) is None
        assert "CUDA" in backend_missing("triton", CPU, LLAMA_FACTS)
        assert "CUDA" in backend_missing("torch_varlen", CPU, LLAMA_FACTS)
        assert choose(CPU, LLAMA_FACTS).backend == "sdpa"
        assert "unknown attention backend" in backend_missing("flash_attention_2", CPU, LLAMA_FACTS)

    def test_soft_capped_attention_is_refused_with_the_reason(self) -> None:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config = Gemma2Config(**COMMON, head_dim=16)
        reason = model_reason(config)
        assert "soft-caps attention logits" in reason
        facts = ModelFacts("gemma2", head_dim=16, packed_attention=reason)
        assert "soft-caps attention logits" in packed_attention_missing(CPU, facts)
        decision = choose(CPU, facts)
        assert not decision.enabled and "soft-caps attention logits" in decision.reason
        with pytest.raises(ValueError, match="soft-caps"):
            PackedAttention("sdpa").install(Gemma2ForCausalLM(config))

    def test_bidirectional_config_is_refused(self) -> None:
        from transformers import GemmaConfig

        config = GemmaConfig(**COMMON, head_dim=16, use_bidirectional_attention=True)
        assert "bidirectional" in model_reason(config)

    def test_flex_cannot_train_on_cpu(self) -> None:
        assert backend_missing("flex", CPU, LLAMA_FACTS) == (
            "the flex backend needs a CUDA device, training runs on cpu"
        )

    def test_gpu_kernels_say_what_this_torch_or_model_lacks(self) -> None:
        assert "has no flex attention" in backend_missing("flex", H100, LLAMA_FACTS)
        assert "needs torch >= 2.12" in backend_missing("torch_varlen", H100, LLAMA_FACTS)
        assert backend_missing("triton", H100, LLAMA_FACTS) == "not probed"  # the fake's default
        triton_runs = dataclasses.replace(H100, triton_varlen=None)
        assert backend_missing("triton", triton_runs, LLAMA_FACTS) is None
        odd_head = dataclasses.replace(LLAMA_FACTS, head_dim=96)
        assert backend_missing("triton", triton_runs, odd_head) == "head dim 96 is not one of 64, 128"
        assert choose(triton_runs, LLAMA_FACTS).backend == "triton"


@pytest.mark.slow  # 2 x 100 LoRA steps: ~6 s on 2 cores
class TestLossCurve:
    def test_100_steps_all_on_and_all_off_follow_the_same_curve(self) -> None:
        """All on: metadata cache + fused loss. All off: rebuild per layer + full-logits loss.

        Tolerance: 2e-3 absolute per step on losses near 5 that fall by more than 0.5. The first
        steps agree to ~5e-7 (fp32 summation order of the two losses); AdamW then amplifies that
        chaotically, measured up to ~3.5e-4 by step 100.
        """
        batches = []
        for i in range(
            4
        ):  # a fixed set, cycled, so the model can fit it and the curve moves
            lengths = [5 + (i * 7 + j * 3) % 11 for j in range(3)]
            batches.append((lengths, *_batch(lengths, seed=100 + i)))
        curves = {}
        for all_on in (True, False):
            model = _lora(_model("llama"), checkpointing=False)
            attn = install(model, "sdpa", cache=all_on)
            optim = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=3e-3
            )
            curve = []
            for step in range(100):
                lengths, ids, targets = batches[step % len(batches)]
                meta = attn.metadata(lengths, "cpu")
                if all_on:
                    num = int((targets != -100).sum())
                    loss = causal_lm_loss(
                        model, ids, targets, num_items=num, **meta.model_kwargs()
                    )
                else:
                    loss = _packed_loss(model, ids, targets, meta)
                loss.backward()
                optim.step()
                optim.zero_grad()
                curve.append(loss.item())
            curves[all_on] = curve
        on, off = curves[True], curves[False]
        assert all(math.isfinite(x) for x in on)
        assert (
            on[-1] < on[0] - 0.5
        )  # it learns: the comparison is not between two flat lines
        assert max(abs(a - b) for a, b in zip(on, off)) < 2e-3
