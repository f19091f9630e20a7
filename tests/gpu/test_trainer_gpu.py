"""The whole trainer on a CUDA device: `python -m trainer run` on tiny models with every switch on auto.

Proves on real hardware what the CPU suite cannot: the plan picks the CUDA backends (Triton varlen
attention, grouped MoE routing), the run succeeds end to end with bf16 autocast and CUDA-event
timings, and the step events carry GPU memory and MFU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
from trainer_helpers import events_of, make_job, run_cli  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _tiny_model_with_head_dim_64(directory: Path, arch: str) -> Path:
    """trainer.model.tiny's model at head dim 64 (its default 16 is below what the varlen kernel takes)."""
    from transformers import AutoModelForCausalLM

    from trainer.model.tiny import build_config, build_tokenizer

    tokenizer = build_tokenizer()
    config = build_config(arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                          tokenizer.eos_token_id)
    config.head_dim = 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss", "qwen3_moe"])
def test_a_short_run_succeeds_on_cuda_with_every_switch_on_auto(tmp_path: Path, arch: str) -> None:
    from trainer.config import DataConfig

    model_dir = _tiny_model_with_head_dim_64(tmp_path / "model", arch)
    job = make_job(
        tmp_path, model_dir, device="cuda", gradient_checkpointing=True,
        data=DataConfig(str(tmp_path / "train.jsonl"), max_seq_len=64, batch_tokens=512),
    )
    job.save(tmp_path / "job.json")
    result = run_cli("run", str(tmp_path / "job.json"), timeout=300)
    events = events_of(result.stdout)
    done = [e for e in events if e["type"] == "done"]
    assert done and done[-1]["status"] == "succeeded", result.stderr[-3000:]

    plan = next(e for e in events if e["type"] == "plan")
    decisions = {d["name"]: d for d in plan["decisions"]}
    print(arch, {n: (d["enabled"], d["backend"], d["reason"]) for n, d in decisions.items()})
    assert decisions["packed_metadata_cache"]["enabled"]
    assert decisions["attention"]["enabled"]
    assert decisions["attention"]["backend"] in ("triton", "torch_varlen")
    if arch in ("gpt_oss", "qwen3_moe"):
        assert decisions["moe_grouped_routing"]["enabled"], decisions["moe_grouped_routing"]["reason"]

    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == job.optim.max_steps
    assert all(s["gpu_mem_peak"] and s["gpu_mem_peak"] > 0 for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
