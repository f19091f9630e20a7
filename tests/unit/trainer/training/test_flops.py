"""trainer.training.flops: the one FLOP count of the trainer's MFU and the bench's, hand-checked on tiny models.

The tiny shapes (hidden 8, 2 layers, 2 query heads and 1 key/value head of dim 4, vocabulary 32,
untied head) give, per decoder layer: q 8x8 = 64, k 8x4 = 32, v 32, o 64 parameters; a Llama MLP
of width 16 is gate, up, down 3 x 128 = 384, a GPT-OSS MoE of 4 experts of width 6, top-2, is the
router 4x8 = 32 plus 2/4 of the experts' gate_up [4, 8, 12] and down [4, 6, 8] (2 x (96 + 48) = 288).
The head is 8 x 32 = 256. Samples of lengths 3 and 4 have 6 + 10 = 16 causal (query, key) pairs;
a window of 2 keys leaves 5 + 7 = 12.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from trainer.training.flops import AttentionLayers, FlopCounter, attention_layers

pytest.importorskip("peft")
# peft 0.21 reads transformers' deprecated is_gradient_checkpointing (not ours to fix)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TINY = {
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}
LENGTHS = [3, 4]
LLAMA_PARAMS = 2 * (64 + 32 + 32 + 64 + 384) + 256  # 1408
GPT_OSS_PARAMS = 2 * (64 + 32 + 32 + 64 + 32 + 288) + 256  # 1280
FULL_ATTENTION = 3.5 * 4 * 8 * 16  # per layer: forward 4 * Hq*D * pairs, backward 2.5x
WINDOW_ATTENTION = 3.5 * 4 * 8 * 12


def tiny_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**TINY, intermediate_size=16))


def tiny_gpt_oss() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(**TINY, intermediate_size=6, num_local_experts=4, num_experts_per_tok=2, sliding_window=2)
    return AutoModelForCausalLM.from_config(config)


def lora(model: torch.nn.Module, targets: list[str], **extra) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, lora_alpha=2, lora_dropout=0.0, target_modules=targets, **extra))


class TestStepFlops:
    def test_frozen_weights_cost_4_per_token_and_trainable_ones_6(self):
        assert FlopCounter(frozen_params=1000, trainable_params=10).matmul_flops_per_token() == 4060

    def test_a_step_adds_in_sample_causal_attention_at_3_5x_its_forward(self):
        counter = FlopCounter(1000, 10, (AttentionLayers(2, width=8),))
        assert counter.step_flops(LENGTHS) == 4060 * 7 + 2 * FULL_ATTENTION

    def test_a_window_bounds_the_keys_each_query_sees(self):
        assert AttentionLayers(1, 8).pairs(LENGTHS) == 16
        assert AttentionLayers(1, 8, window=2).pairs(LENGTHS) == 3 + 2 + 3 + 2 * 2
        assert AttentionLayers(1, 8, window=4).pairs(LENGTHS) == 16

    def test_windows_follow_layer_types_and_every_mistral_layer(self):
        def config(**kw):
            return types.SimpleNamespace(num_attention_heads=2, head_dim=4, num_hidden_layers=3, **kw)

        assert attention_layers(config(sliding_window=None)) == (AttentionLayers(3, 8),)
        alternating = config(sliding_window=5, layer_types=["sliding_attention", "full_attention"] * 2)
        assert attention_layers(alternating) == (AttentionLayers(2, 8, 5), AttentionLayers(1, 8))
        assert attention_layers(config(sliding_window=5, model_type="mistral")) == (AttentionLayers(3, 8, 5),)
        # Qwen3 carries a sliding_window it does not use: every layer type is full.
        qwen3 = config(sliding_window=5, layer_types=["full_attention"] * 3, model_type="qwen3")
        assert attention_layers(qwen3) == (AttentionLayers(3, 8),)

    def test_the_module_imports_without_torch(self):
        import subprocess

        code = "import sys, trainer.training.flops; assert 'torch' not in sys.modules"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[4])


class TestForModel:
    def test_a_full_fine_tune_trains_every_matmul_weight_and_skips_the_embeddings(self):
        counter = FlopCounter.for_model(tiny_llama())
        assert (counter.frozen_params, counter.trainable_params) == (0, LLAMA_PARAMS)
        assert counter.attention == (AttentionLayers(2, 8),)
        assert counter.step_flops(LENGTHS) == 6 * LLAMA_PARAMS * 7 + 2 * FULL_ATTENTION

    def test_lora_counts_the_frozen_base_and_its_own_a_and_b(self):
        model = lora(tiny_llama(), ["q_proj", "v_proj"])
        counter = FlopCounter.for_model(model)
        # rank 2: q 2*(8+8) = 32, v 2*(8+4) = 24, in each of 2 layers
        assert (counter.frozen_params, counter.trainable_params) == (LLAMA_PARAMS, 2 * (32 + 24))
        assert counter.step_flops(LENGTHS) == (4 * 1408 + 6 * 112) * 7 + 2 * FULL_ATTENTION == 47_712

    def test_disabled_adapters_count_only_the_base(self):
        model = lora(tiny_llama(), ["q_proj", "v_proj"])
        with model.disable_adapter():
            counter = FlopCounter.for_model(model)
        assert (counter.frozen_params, counter.trainable_params) == (LLAMA_PARAMS, 0)

    def test_moe_counts_the_router_and_the_top_k_of_the_experts(self):
        counter = FlopCounter.for_model(tiny_gpt_oss())
        assert (counter.frozen_params, counter.trainable_params) == (0, GPT_OSS_PARAMS)
        # GPT-OSS alternates sliding (window 2) and full layers
        assert counter.attention == (AttentionLayers(1, 8, window=2), AttentionLayers(1, 8))
        assert counter.step_flops(LENGTHS) == 6 * GPT_OSS_PARAMS * 7 + FULL_ATTENTION + WINDOW_ATTENTION == 56_896

    def test_lora_on_the_expert_weights_gives_them_a_weight_gradient(self):
        """peft's target_parameters adds B A to the expert weight: the sum's gradient is computed."""
        model = lora(tiny_gpt_oss(), ["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        counter = FlopCounter.for_model(model)
        experts, q_lora = 2 * 288, 2 * 2 * (8 + 8)
        assert counter.trainable_params == experts + q_lora
        assert counter.frozen_params == GPT_OSS_PARAMS - experts

    def test_a_4bit_linear_counts_its_logical_shape(self):
        """bitsandbytes stores two 4-bit weights per byte; in_features x out_features is what runs."""
        model = tiny_llama()
        head = model.lm_head
        head.weight = torch.nn.Parameter(torch.zeros(8 * 32 // 2, 1, dtype=torch.uint8), requires_grad=False)
        counter = FlopCounter.for_model(model)
        assert counter.frozen_params == 256 and counter.trainable_params == LLAMA_PARAMS - 256


@pytest.mark.slow  # peft wraps an 8B model on the meta device twice: seconds on 2 cores, no memory
class TestBenchShape:
    def test_the_trainers_count_of_the_llama_8b_run_equals_the_bench_count(self):
        """The trainer's model (trainer.model.load.apply_lora) and the bench's (bench.workload), both walked
        by FlopCounter.for_model as the step and bench.train_step do, against the shape's arithmetic."""
        from transformers import AutoModelForCausalLM

        from bench.workload import LLAMA_3_1_8B as s
        from bench.workload import LORA_TARGETS, build_lora_model, packed_steps
        from trainer.config import LoraConfig
        from trainer.model.load import apply_lora

        meta = torch.device("meta")
        with meta:
            base = AutoModelForCausalLM.from_config(s.config(), dtype=torch.bfloat16)
        trainer_counter = FlopCounter.for_model(apply_lora(base, LoraConfig(r=16, alpha=16, target_modules=LORA_TARGETS)))
        bench_counter = FlopCounter.for_model(build_lora_model(s, meta)[0])
        assert trainer_counter == bench_counter

        hq, hkv, h, i = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.intermediate
        frozen = s.layers * (h * (2 * hq + 2 * hkv) + 3 * h * i) + h * s.vocab
        lora_shapes = [(h, hq), (h, hkv), (h, hkv), (hq, h), (h, i), (h, i), (i, h)]
        trainable = s.layers * sum(16 * (a + b) for a, b in lora_shapes)
        assert (trainer_counter.frozen_params, trainer_counter.trainable_params) == (frozen, trainable)
        assert (frozen, trainable) == (7_504_658_432, 41_943_040)
        lengths = packed_steps(1)[0]
        pairs = sum(n * (n + 1) // 2 for n in lengths)
        assert (sum(lengths), pairs) == (16_384, 6_099_045)
        expected = (4 * frozen + 6 * trainable) * 16_384 + 3.5 * 4 * hq * s.layers * pairs
        assert trainer_counter.step_flops(lengths) == pytest.approx(expected, rel=1e-12)
        assert expected == pytest.approx(507.14e12, rel=1e-4)
