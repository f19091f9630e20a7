"""bench.sampler on the CPU (fp32, a tiny Llama with its LoRA adapter): every row is produced and
the sampler's greedy tokens are HF ``generate``'s (fp32: 100% agreement, the full prefix), so the
agreement row the GPU run reports is computed on the same tokens the timed rows generate."""

from __future__ import annotations

import json

import pytest

from bench import sampler

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]


def test_a_tiny_cpu_run_reports_every_row_and_full_agreement(tmp_path) -> None:
    import torch

    out = tmp_path / "rows.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one matmul reduction order for HF's and the sampler's forwards
    try:
        code = sampler.main(["--tiny", "--device", "cpu", "--batches", "1", "3", "--hf-batches", "3",
                             "--prompt-tokens", "5", "--new-tokens", "6", "--ttft-prompt", "12",
                             "--agree-batch", "3", "--agree-tokens", "6", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    rows = json.loads(out.read_text())
    labels = [(r["label"], r["batch"]) for r in rows]
    assert labels == [
        ("HF generate (peft, dynamic cache)", 3),
        ("ftq sampler (fused LoRA)", 1),
        ("ftq sampler (fused LoRA)", 3),
        ("greedy agreement with HF", 3),
        ("time to first token, 12-token prompt", 1),
    ]
    assert all(r["tokens"] == r["batch"] * 6 and r["tokens_per_s"] > 0 for r in rows[:3])
    assert rows[2]["note"].endswith("x HF")
    assert rows[3]["note"] == "100.0% of the first 6 tokens identical; mean identical prefix 6.0"


def test_agreement_counts_positions_and_the_identical_prefix() -> None:
    import torch

    hf = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    share, prefix = sampler.agreement(hf, [[1, 2, 9, 4], [5, 6, 7, 8]], 4)
    assert share == 7 / 8 and prefix == (2 + 4) / 2
