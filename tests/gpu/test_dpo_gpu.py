"""DPO on a CUDA device: the product path end to end, and a micro-batch with no host sync.

Run on the lent GPU: ``python -m pytest -m gpu tests/gpu/test_dpo_gpu.py``. Skipped without CUDA.
``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing CUDA call into a
RuntimeError, so the DPO loss (policy pass, adapters-off reference pass, per-sequence log-probs
from the fused head, pair statistics) and its backward are checked to queue without one.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_helpers import no_host_sync  # noqa: E402
from trainer_helpers import events_of, make_job, run_cli, tiny_model_for_gpu, write_jsonl  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _pairs(n: int = 32) -> list[dict]:
    return [
        {"input": {"messages": [{"role": "user", "content": f"What is {i % 7} plus one?"}]},
         "preferred_output": [{"role": "assistant", "content": f"The answer is {i % 7 + 1}."}],
         "non_preferred_output": [{"role": "assistant", "content": "I do not know, sorry about that."}]}
        for i in range(n)
    ]


def test_a_dpo_run_succeeds_on_cuda_with_every_switch_on_auto(tmp_path: Path) -> None:
    from trainer.config import DataConfig, DpoConfig, OptimConfig

    model_dir = tiny_model_for_gpu(tmp_path / "model", "llama")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", _pairs())
    job = make_job(
        tmp_path, model_dir, device="cuda", gradient_checkpointing=True, objective="dpo", dpo=DpoConfig(beta=0.1),
        data=DataConfig(str(pairs), max_seq_len=64, batch_tokens=512),
        optim=OptimConfig(max_steps=10, learning_rate=5e-3),
    )
    job.save(tmp_path / "job.json")
    result = run_cli("run", str(tmp_path / "job.json"), timeout=300)
    events = events_of(result.stdout)
    done = [e for e in events if e["type"] == "done"]
    assert done and done[-1]["status"] == "succeeded", result.stderr[-3000:]
    decisions = {d["name"]: d for d in next(e for e in events if e["type"] == "plan")["decisions"]}
    assert decisions["attention"]["enabled"] and decisions["loss"]["backend"] == "fused_chunked_ce"
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 10
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=2e-3)
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["reward_margin"] > 0
    assert all(s["gpu_mem_peak"] > 0 and s["reward_accuracy"] is not None for s in steps)


def test_a_dpo_micro_batch_queues_without_a_host_sync(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.objectives import dpo
    from trainer.features.attention.packed import PackedAttention
    from trainer.config import DpoConfig, LoraConfig
    from trainer.model.load import apply_lora
    from trainer.features.loss.packed_forward import LOSS_FUSED
    from trainer.data.packing import pack_batch
    from trainer.objectives.preference import tokenize_pair

    model_dir = tiny_model_for_gpu(tmp_path / "model", "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir).cuda(), LoraConfig(r=8, alpha=16))
    attention = PackedAttention("sdpa", cache=True)
    attention.install(model)
    batch = pack_batch([tokenize_pair(r, tokenizer) for r in _pairs(8)]).to("cuda", non_blocking=True)
    meta = attention.metadata(batch.lengths, "cuda")
    loss = dpo.DpoLoss(DpoConfig(), LOSS_FUSED)
    stats = dpo.new_stats(torch.device("cuda"))
    with no_host_sync(), torch.autocast("cuda", dtype=torch.bfloat16):
        value = loss(model, batch, meta, 8)
        value.backward()
        stats += loss.last
    assert value.item() == pytest.approx(math.log(2), abs=1e-2)  # a new adapter: policy = reference
    assert dpo.step_fields(stats)["reward_accuracy"] is not None
