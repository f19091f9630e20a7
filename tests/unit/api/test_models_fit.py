"""``api.models.fit``: whether a model trains on the live GPU hosts, from ``trainer.plan.memory``'s estimate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from api.models.fit import BATCH_TOKENS, LORA_RANK, GpuHost, fit, shape_of
from trainer.plan import memory

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "tie_word_embeddings": True}
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
H100 = 80 * GIB


class TestFit:
    def test_a_small_model_fits_one_gpu_for_both_methods_with_the_trainers_estimate(self) -> None:
        shape = shape_of(QWEN3_0_6B, 596_049_920)
        host = GpuHost("box", 1, H100, bf16=True)

        lora, full = fit(shape, [host], "lora"), fit(shape, [host], "full")

        assert (lora.fits, lora.gpus, full.fits, full.gpus) == (True, 1, True, 1)
        work = memory.Workload(tokens=BATCH_TOKENS, max_seq_len=4096, method="full", lora_rank=LORA_RANK)
        assert full.peak_bytes == memory.estimate(shape, work, "full+offload").peak
        assert full.reason.startswith("1 GPU of box: est. ") and "80.0 GiB a GPU" in full.reason

    def test_a_70b_model_needs_several_gpus_for_lora_and_more_than_8_for_full(self) -> None:
        shape = shape_of(LLAMA_70B, 70_553_706_496)
        host = GpuHost("box", 8, H100, bf16=True)

        lora, full = fit(shape, [host], "lora"), fit(shape, [host], "full")

        assert lora.fits and lora.gpus == 4  # 141 GB of bf16 weights sharded four ways, activations checkpointed
        assert full.fits is False and full.gpus is None
        assert full.peak_bytes > H100 and "not on 8 GPUs of box" in full.reason and "use LoRA" in full.reason

    def test_the_host_needing_fewest_gpus_is_named(self) -> None:
        shape = shape_of(LLAMA_70B, None)
        small, big = GpuHost("small", 2, 24 * GIB, bf16=True), GpuHost("big", 8, 141 * GIB, bf16=True)
        lora = fit(shape, [small, big], "lora")
        assert lora.fits and "of big" in lora.reason

    def test_unknown_without_a_gpu_host_or_without_the_sizes(self) -> None:
        assert fit(shape_of(QWEN3_0_6B, None), [], "lora").fits is None
        unsized = fit(shape_of({"model_type": "llama"}, 10), [GpuHost("box", 1, H100, True)], "full")
        assert unsized.fits is None and "num_hidden_layers" in unsized.reason

    def test_a_multimodal_config_is_read_from_its_text_config(self) -> None:
        shape = shape_of({"model_type": "gemma3", "text_config": {**QWEN3_0_6B, "model_type": "gemma3_text"}}, None)
        assert shape is not None and (shape.layers, shape.hidden, shape.qk_norm) == (28, 1024, True)


def test_the_estimate_runs_without_torch() -> None:
    """The API estimates fits (``GET /v1/models``) and must not import torch to do it."""
    code = ("import sys; from api.models.fit import GpuHost, fit, shape_of; from tests.unit.api.test_models_fit "
            "import QWEN3_0_6B; fit(shape_of(QWEN3_0_6B, None), [GpuHost('b', 2, 2**36, True)], 'full'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
