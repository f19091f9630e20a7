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
from trainer_helpers import events_of, make_job, run_cli, tiny_model_for_gpu  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss", "qwen3_moe"])
def test_a_short_run_succeeds_on_cuda_with_every_switch_on_auto(tmp_path: Path, arch: str) -> None:
    from trainer.config import DataConfig

    model_dir = tiny_model_for_gpu(tmp_path / "model", arch)
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
