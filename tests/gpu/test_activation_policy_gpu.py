"""The OOM ladder on a real CUDA out-of-memory error (the CPU suite injects it through a probe).

A random-weight Llama of 8 layers (hidden 1024, MLP 4096) trains on ~16k-token packed steps with
every activation kept (``gradient_checkpointing: off``): about 5 GiB of saved activations. The
process's CUDA allocator is capped at 3 GiB (``torch.cuda.set_per_process_memory_fraction``), so
the first step runs out of memory for real; the ladder must step down (selective, then full if
needed) and the run must finish, saying so in a warning. Run in-process: the cap is this
process's. Not yet run on a GPU when written (issue 13): the lead's GPU pass checks it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
from trainer_helpers import Recorder  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CAP_BYTES = 3 << 30


def _model(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.model.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=8192,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _long_texts(path: Path, count: int = 24) -> Path:
    from trainer.model.tiny import corpus_text

    words = corpus_text().split()
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(4000))}) + "\n")
    return path


def test_a_real_oom_steps_down_and_the_run_finishes(tmp_path: Path) -> None:
    from trainer.config import DataConfig, LoraConfig, ModelConfig, OptimConfig, TrainConfig
    from trainer.training.train import run

    config = TrainConfig(
        model=ModelConfig(str(_model(tmp_path / "model"))),
        data=DataConfig(str(_long_texts(tmp_path / "train.jsonl")), max_seq_len=4096, batch_tokens=16_384),
        optim=OptimConfig(max_steps=2, learning_rate=1e-4),
        lora=LoraConfig(r=16, alpha=16),
        output_dir=str(tmp_path / "out"),
        gradient_checkpointing="off",
        device="cuda",
    )
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_BYTES / total)
    events = Recorder()
    try:
        result = run(config, events)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert result.status == "succeeded", result.message
    warnings = [m["message"] for m in events.of("log") if m["level"] == "warning"]
    print("\n".join(warnings))
    assert warnings and warnings[0].startswith("out of memory at step 1 with activation policy none")
    assert [s["step"] for s in events.of("step")] == [1, 2]
    assert all(s["gpu_mem_peak"] <= CAP_BYTES for s in events.of("step"))
