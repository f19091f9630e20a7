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
        ("ftq sampler (trainer kernels)", 1),
        ("ftq sampler (trainer kernels)", 3),
        ("greedy agreement with HF", 3),
        ("time to first token, 12-token prompt", 1),
    ]
    assert all(r["tokens"] == r["batch"] * 6 and r["tokens_per_s"] > 0 for r in rows[:3])
    assert rows[2]["note"].endswith("x HF")
    assert rows[3]["note"] == "100.0% of the first 6 tokens identical; mean identical prefix 6.0"


def test_variants_are_timed_one_after_the_other_and_leave_the_product_settings(tmp_path, monkeypatch) -> None:
    from trainer.generate import kernels

    at_uninstall = []  # what the served model had when the bench gave it back
    uninstall = kernels.ServingKernels.uninstall
    monkeypatch.setattr(kernels.ServingKernels, "uninstall",
                        lambda self: at_uninstall.append(self.describe()) or uninstall(self))
    out = tmp_path / "rows.json"
    assert sampler.main(["--tiny", "--device", "cpu", "--batches", "2", "--hf-batches", "--prompt-tokens", "4",
                         "--new-tokens", "3", "--ttft-prompt", "5", "--variants", "ftq", "session-17",
                         "--json", str(out)]) == 0
    labels = [r["label"] for r in json.loads(out.read_text())]
    assert labels == ["ftq sampler (trainer kernels)", "ftq sampler (trainer kernels, session-17)",
                      "time to first token, 5-token prompt", "time to first token, 5-token prompt (session-17)"]
    assert "4 groups of LoRA layers" in at_uninstall[0] and "(4 with their base weights" in at_uninstall[0]


def test_the_before_switches_name_their_rows(tmp_path, monkeypatch) -> None:
    from trainer.generate import attention

    monkeypatch.setattr(attention, "plan_prefill", attention.plan_prefill)  # main replaces it
    out = tmp_path / "rows.json"
    assert sampler.main(["--tiny", "--device", "cpu", "--batches", "2", "--hf-batches", "--prompt-tokens", "4",
                         "--new-tokens", "3", "--ttft-prompt", "6", "--lora-only", "--no-batched-prefill",
                         "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["label"] == "ftq sampler (fused LoRA only, a prompt a call)" and rows[0]["tokens"] == 6
    assert attention.plan_prefill([(0, 0, 4), (1, 0, 4)], False, torch_cpu()) is None  # switched off


def test_the_profile_bench_splits_prefill_from_decode_steps(tmp_path) -> None:
    from bench import sampler_profile

    out = tmp_path / "profile.json"
    assert sampler_profile.main(["--tiny", "--device", "cpu", "--batches", "3", "--prompt-tokens", "5",
                                 "--new-tokens", "6", "--profile-steps", "2", "--host-profile",
                                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["prefill_steps"] == 1 and row["prefill_tokens"] == 15  # three 5-token prompts, one step
    assert row["decode_steps"] == 5 and row["steps"] == 6  # the first token comes from the prefill
    assert "function calls" in row["host"]["stats"]


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_agreement_counts_positions_and_the_identical_prefix() -> None:
    import torch

    hf = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    share, prefix = sampler.agreement(hf, [[1, 2, 9, 4], [5, 6, 7, 8]], 4)
    assert share == 7 / 8 and prefix == (2 + 4) / 2
